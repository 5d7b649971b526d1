"""The ``kvstore`` command: the typer app, its subcommands registered in help order.

Exit codes: 0 ok, 1 the node refused (bad namespace, bad input), 2 usage,
3 the node cannot be reached, 4 admin credentials refused, 5 not configured
(no Redis for a cluster view), 130 interrupted.

The command modules expose plain functions (``COMMANDS``) and import only
`kvstore.cli.common`; this module imports them and registers them, so no
command module imports the app.
"""

from __future__ import annotations

import sys

import typer

from kvstore.cli import admin, bench, drop, live, reads

app = typer.Typer(
    name="kvstore",
    help="Inspect and manage kvstore cache nodes (docs/operations.md).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for _command in (*reads.COMMANDS, *admin.COMMANDS, *drop.COMMANDS, *bench.COMMANDS, *live.COMMANDS):
    app.command()(_command)


def main() -> None:
    """The ``kvstore`` console script."""
    try:
        app()
    except KeyboardInterrupt:
        print("kvstore: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
