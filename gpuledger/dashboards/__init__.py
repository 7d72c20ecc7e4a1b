"""Grafana dashboards for gpuledger, generated from code (``python -m gpuledger.dashboards.build``) and shipped as
package data (``gpuledger dashboards export DIR``)."""
