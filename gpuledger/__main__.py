"""`python -m gpuledger`: the same command as the `gpuledger` script."""

from gpuledger.cli import app

app(prog_name="gpuledger")
