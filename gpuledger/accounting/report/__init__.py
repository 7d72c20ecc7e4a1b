"""Usage reports, by responsibility; pure: rows in, rows out (HTML rendering in ``accounting.html``).

- ``errors``: ReportError, the one exception bad report input raises.
- ``period``: the period rule, period and time parsing.
- ``settings``: the ``[report]`` table of gpuledger.toml (prices, emission factor, thresholds).
- ``grid``: grid carbon intensity over time.
- ``tables``: table, JSON and CSV rendering shared by the reports.
- ``jobs``: per-job rows and per account/user subtotals.
- ``usage``: the usage report over a period, grouped by account, user, partition, GPU model or node.
- ``idle``: jobs that held GPUs mostly idle.
"""
