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
from typing import Annotated, Any

import typer

import kvstore
from kvstore.cli import admin, bench, drop, live, query, reads
from kvstore.cli.common import EXIT_USAGE, TARGET_HELP, set_global_target

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


def _click_class(name: str) -> type[Exception]:
    """Click's exception class ``name``, from whichever click typer runs on.

    typer 0.2x vendors click (``typer._click``, private) where earlier
    versions use ``click`` itself; `typer.BadParameter` derives from the
    right ``UsageError`` and ``ClickException`` in both.
    """
    found: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)
    return found


_UsageError = _click_class("UsageError")
_ClickException = _click_class("ClickException")


def usage_line(exc: Any) -> str:
    """A usage error (click's ``UsageError``) in one line: what was wrong, where the help is.

    Click, through typer's rich boxes, prints the usage and a framed error,
    five lines or more; one line that names the flag and the command's
    ``--help`` is what a person at a shell needs.
    """
    message = " ".join(str(exc.format_message()).split())
    message = message[:1].lower() + message[1:].rstrip(".")
    command = exc.ctx.command_path if exc.ctx is not None else "kvstore"
    return f"kvstore: {message} (see {command} --help)"


def main() -> None:
    """The ``kvstore`` console script."""
    try:
        code = app(prog_name="kvstore", standalone_mode=False)
    except _UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `kvstore`: the help, as before
            exc.show()  # type: ignore[attr-defined]
        else:
            print(usage_line(exc), file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    except _ClickException as exc:
        exc.show()  # type: ignore[attr-defined]
        raise SystemExit(exc.exit_code) from None  # type: ignore[attr-defined]
    except typer.Abort:
        print("kvstore: aborted", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print("kvstore: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    # Not standalone: typer returns the code of a `typer.Exit`, else the command's None.
    raise SystemExit(code if isinstance(code, int) else 0)
