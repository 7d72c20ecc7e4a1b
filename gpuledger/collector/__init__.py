"""gpuledger collector: ingests agents' sample batches, aggregates per job, stores time series."""
