"""gpuledger agent: samples GPUs, attributes them to jobs, exposes /metrics and pushes to the collector."""
