"""`python -m gpuledger`: the same command as the `gpuledger` script."""

from gpuledger.cli import main

main()
