"""gpuledger accounting: fairshare on measured usage, the Slurm priority feed, reports and audit."""
