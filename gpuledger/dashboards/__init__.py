"""Grafana dashboards for gpuledger, generated from code (``python -m gpuledger.dashboards.build``).

Not part of the installed package: run from the repository root (it imports ``agent`` for metric names).
"""
