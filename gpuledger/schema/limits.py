"""What one batch may hold by default: the collector's limits (``collector.validate.Limits``, settable in its config),
which an agent's batches must fit (``agent.push.BatchLimits`` splits them). Here because the agent cannot import
the collector; both read these numbers."""

MAX_BODY_BYTES = 16 * 1024 * 1024  # decoded (uncompressed); a 5,000-sample JSON batch is about 5 MB, msgpack 0.4 MB
MAX_SAMPLES = 20_000  # per batch, all series together; a default agent batch has 80
MAX_SERIES = 1_024  # series (and GPUs and MIG instances) per batch
MAX_BATCH_JOB_IDS = 1_024  # distinct job ids in one batch
# per sample (or series): the jobs sharing one GPU at once (over it, the agent sends the sample without job ids:
# its use measured, charged to no job; agent.push.HttpPusher.fit)
MAX_SAMPLE_JOB_IDS = 64
MAX_JOBS = 1_024  # job records riding with one batch
# per sample: processes, Xid errors (over it, the agent sends the processes using the most memory and the first Xid
# errors: agent.push.fit_rows); per job record: GPUs, TRES, earlier runs
MAX_ROW_LIST = 256
# per job record: the hosts it ran on (a job of 300 nodes is an ordinary large job; Slurm's largest clusters hold about
# 10,000 nodes)
MAX_JOB_HOSTS = 65_536
# per batch, all samples together: processes, and Xid errors (each); all job records together: hosts. A process is
# 3 bytes of msgpack but ~100 of memory at the collector, a host name 3 bytes and ~50.
MAX_BATCH_LIST = 256_000
