"""What the audit tests run the CLI with: one accounting config (classic fairshare, allocation charge, two users of
one account) and ``run``, the CLI in process, never with a traceback."""

from __future__ import annotations

from typer.testing import CliRunner

from gpuledger.cli import app

runner = CliRunner()

CONFIG = """
[accounting]
algorithm = "classic"
policy = "allocated"
priority_weight = 1000
[accounts.a]
shares = 1
users = { alice = 1, bob = 1 }
"""


def run(*args):
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output  # never a traceback
    return r
