"""What one batch may hold by default: the collector's limits (``collector.validate.Limits``, settable in its config),
which an agent's batches must fit (``agent.push.BatchLimits`` splits them). Here because the agent cannot import
the collector; both read these numbers."""

MAX_BODY_BYTES = 16 * 1024 * 1024  # decoded (uncompressed); a 5,000-sample JSON batch is about 5 MB, msgpack 0.4 MB
MAX_SAMPLES = 20_000  # per batch, all series together; a default agent batch has 80
MAX_SERIES = 1_024  # series (and GPUs and MIG instances) per batch
MAX_BATCH_JOB_IDS = 1_024  # distinct job ids in one batch
MAX_JOBS = 1_024  # job records riding with one batch
# per batch, all samples together: processes, and Xid errors (each). A process is 3 bytes of msgpack but ~100 of
# memory at the collector.
MAX_BATCH_LIST = 256_000
