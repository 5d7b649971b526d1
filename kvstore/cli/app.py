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
from typing import Annotated

import typer

import kvstore
from kvstore.cli import admin, bench, drop, live, query, reads
from kvstore.cli.common import TARGET_HELP, set_global_target

app = typer.Typer(
    name="kvstore",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        print(f"kvstore {kvstore.__version__}")
        raise typer.Exit()


@app.callback()
def options(
    ctx: typer.Context,
    target: Annotated[
        str | None,
        typer.Option("--target", "-t", envvar="KVSTORE_TARGET", help=TARGET_HELP),
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Inspect and manage kvstore cache nodes (docs/operations.md).

    Options given before the command apply to every command; a command's own
    --target wins over the global one.
    """
    set_global_target(ctx, target)


for _command in (
    *reads.COMMANDS,
    *query.COMMANDS,
    *admin.COMMANDS,
    *drop.COMMANDS,
    *bench.COMMANDS,
    *live.COMMANDS,
):
    app.command()(_command)


def main() -> None:
    """The ``kvstore`` console script."""
    try:
        app()
    except KeyboardInterrupt:
        print("kvstore: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
