"""Registers the session fixture ``slurm_cluster`` (defined in slurm_cluster.py, which the tests also import)."""

from slurm_cluster import slurm_cluster  # noqa: F401
