"""Test-suite root. Without __init__.py files, pytest puts this folder on sys.path (rootdir imports), so any
test can use the shared harness in tests/servers.py: real InfluxDB, VictoriaMetrics and Prometheus servers."""
