"""What every ``kvstore`` subcommand shares: options, exit codes, the console,
the gRPC connection and the one place RPC errors become messages.

The typer app itself is built in `kvstore.cli.app`, which imports the
command modules and registers their functions; the command modules import
only this module, so registration flows one way.

Exit codes: 0 ok, 1 the node refused (bad namespace, bad input), 2 usage,
3 the node cannot be reached, 4 admin credentials refused, 5 not configured
(no Redis for a cluster view), 130 interrupted.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, NoReturn

import grpc
import typer
from rich import box
from rich.console import Console
from rich.table import Table

from kvstore.errors import KVStoreError
from kvstore.ops import names
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_DENIED = 4
EXIT_NOT_CONFIGURED = 5

DEFAULT_TARGET = "127.0.0.1:50051"
"""The local node (the server's default host and port)."""

TARGET_HELP = "Node address HOST:PORT (default: KVSTORE_TARGET, else the local node)."

Target = Annotated[str, typer.Option("--target", "-t", help=TARGET_HELP)]
"""A command's ``--target``. It has no envvar of its own: the app's global
``--target`` (which reads ``KVSTORE_TARGET``) becomes every command's default
(`set_global_target`), so ``kvstore -t A status``, ``KVSTORE_TARGET=A kvstore
status`` and ``kvstore status -t A`` all work, the last one winning."""
Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of tables.")]
Timeout = Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds per call.")]
Token = Annotated[
    str,
    typer.Option(
        "--token",
        envvar=["KVSTORE_TOKEN", "KVSTORE_ADMIN_TOKEN"],
        help="Token for a node with auth on: a tenant's (sees its own) or the admin's (sees all). "
        "Default: KVSTORE_TOKEN, else KVSTORE_ADMIN_TOKEN.",
        show_default=False,
    ),
]
"""The token of a command that reads a node. With auth on (a tenants file) every RPC
needs one: a tenant's token shows that tenant's namespaces, counters and blocks only,
the admin token everything. First set wins: ``--token``, ``KVSTORE_TOKEN`` (a tenant's
shell), ``KVSTORE_ADMIN_TOKEN`` (an operator's shell). With auth off it is not needed."""
AdminToken = Annotated[
    str,
    typer.Option(
        "--admin-token",
        "--token",
        envvar=["KVSTORE_ADMIN_TOKEN", "KVSTORE_TOKEN"],
        help="The node's admin token. Default: KVSTORE_ADMIN_TOKEN, else KVSTORE_TOKEN.",
        show_default=False,
    ),
]
"""The token of an admin verb: ``--admin-token`` (or ``--token``), then
``KVSTORE_ADMIN_TOKEN``, then ``KVSTORE_TOKEN``: the admin token first, so a shell
holding both a tenant's and the admin token uses the admin's for admin verbs."""

console = Console(highlight=False)
"""Where tables go (stdout)."""


def set_global_target(ctx: typer.Context, target: str | None) -> None:
    """Make ``target`` the default ``--target`` of every subcommand of ``ctx``'s group.

    Through click's ``default_map``: a subcommand's own ``--target`` still
    wins, and commands without the option ignore it.
    """
    if target is None:
        return
    commands = getattr(ctx.command, "commands", {})
    defaults = dict(ctx.default_map or {})
    for name in commands:
        defaults[name] = {**defaults.get(name, {}), "target": target}
    ctx.default_map = defaults


def table(title: str | None = None, *, show_header: bool = True) -> Table:
    """A table that reads at 80 columns (pipes, ssh).

    No side rules, two blanks between columns, and cells that fold onto
    more lines rather than end in "…".
    """
    return Table(
        title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True,
        show_header=show_header, title_justify="left", title_style="bold",
    )  # fmt: skip


def column(t: Table, header: str, *, number: bool = False, keep: int = 0) -> None:
    """Add a column to ``t``.

    A ``number`` is right-aligned and never wrapped; ``keep`` characters (an
    id, a hash prefix) stay on one line; other text folds.
    """
    t.add_column(
        header,
        justify="right" if number else "left",
        overflow="fold",
        min_width=keep or None,
        no_wrap=number or bool(keep),
    )


def size(n: float) -> str:
    """Bytes in binary units (``2.5 KiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def pct(x: float | None) -> str:
    """A ratio as a percentage ("-" when undefined)."""
    return "-" if x is None else f"{100 * x:.1f}%"


def fail(message: str, code: int = EXIT_REFUSED) -> NoReturn:
    """Print ``kvstore: message`` to stderr and exit with ``code``."""
    print(f"kvstore: {message}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


def print_json(doc: Any) -> None:
    """Print ``doc`` as indented JSON on stdout."""
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()


_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_DENIED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def exit_code(code: grpc.StatusCode | None) -> int:
    """The command's exit code for an RPC that ended with ``code``."""
    if code in _UNREACHABLE:
        return EXIT_UNREACHABLE
    if code in _DENIED:
        return EXIT_DENIED
    return EXIT_REFUSED


TOKEN_HINT = "pass --token or set KVSTORE_TOKEN (a tenant's token, or the admin token)"
"""What a read command refused for want of a token says to do."""
ADMIN_TOKEN_HINT = "pass --admin-token or set KVSTORE_ADMIN_TOKEN"
"""The same for an admin verb."""


def describe(exc: grpc.RpcError, target: str, token_hint: str = "") -> str:
    """A one-line message for a failed RPC.

    ``token_hint`` is added when the node wants a token (UNAUTHENTICATED) and
    the command sent none.
    """
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code in _UNREACHABLE:
        return f"cannot reach the kvstore node at {target} ({code.name.lower()}): is it running?"
    # The node's refusal of an admin verb names --admin-token itself.
    if code is grpc.StatusCode.UNAUTHENTICATED and token_hint and "--admin-token" not in details:
        return f"refused ({code.name}): {details}; {token_hint}"
    if code in _DENIED:
        return f"refused ({code.name}): {details}"
    name = code.name if code is not None else "error"
    return f"the node at {target} answered {name}: {details}"


class NodeClient:
    """Synchronous calls to one node; every call carries the timeout."""

    def __init__(self, target: str, channel: grpc.Channel, timeout: float, token: str) -> None:
        self.target = target
        self.stub = kvstore_pb2_grpc.KVStoreStub(channel)
        self.timeout = timeout
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )

    def stats(self) -> pb.StatsResponse:
        """The node's Stats."""
        resp: pb.StatsResponse = self.stub.Stats(
            pb.StatsRequest(), timeout=self.timeout, metadata=self.metadata
        )
        return resp

    def list_blocks(self, namespace: str, page_size: int, token: str) -> pb.ListBlocksResponse:
        """One ListBlocks page."""
        resp: pb.ListBlocksResponse = self.stub.ListBlocks(
            pb.ListBlocksRequest(namespace_id=namespace, page_size=page_size, page_token=token),
            timeout=self.timeout,
            metadata=self.metadata,
        )
        return resp

    def all_blocks(self, namespace: str, limit: int) -> tuple[list[pb.BlockInfo], int]:
        """Up to ``limit`` blocks of ``namespace`` over as many pages as needed, and the total."""
        blocks: list[pb.BlockInfo] = []
        token, total = "", 0
        while len(blocks) < limit:
            page = self.list_blocks(namespace, min(1000, limit - len(blocks)), token)
            blocks.extend(page.blocks)
            total, token = page.total, page.next_page_token
            if not token:
                break
        return blocks, total

    def resolve_namespace(
        self, name: str, stats: pb.StatsResponse | None = None
    ) -> pb.NamespaceStats:
        """The namespace ``name`` names (`kvstore.ops.names`: id, model id, unique prefix).

        An unknown or ambiguous name ends the command (exit 1) with the
        candidates, or every namespace there is, in the message.
        """
        stats = stats if stats is not None else self.stats()
        namespaces = {ns.namespace_id: ns for ns in stats.namespaces}
        try:
            found = names.resolve_namespace(
                name, [(i, ns.model_id) for i, ns in namespaces.items()]
            )
        except KVStoreError as exc:
            fail(f"{exc} (at {self.target})", EXIT_REFUSED)
        return namespaces[found]


_GRPC_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def target_problem(target: str) -> str | None:
    """What is wrong with ``target`` as a node address, or None when it is usable.

    gRPC itself takes a bare host and dials port 443, where no node listens,
    so ``-t 127.0.0.1`` would only time out as "cannot reach": say that the
    port is missing instead. gRPC's own forms (``unix:PATH``, ``dns:///…``,
    ``ipv4:…``) pass untouched.
    """
    if target.startswith(_GRPC_SCHEMES):
        return None
    if target.startswith("["):  # [::1]:50051
        inside, _, rest = target[1:].partition("]")
        host, port = f"[{inside}]", rest[1:] if rest.startswith(":") else ""
    elif target.count(":") > 1:
        return f"--target {target}: write an IPv6 address in brackets, e.g. [::1]:50051"
    else:
        host, _, port = target.partition(":")
    if not host or host == "[]":
        return f"--target {target!r} has no host: give HOST:PORT, e.g. {DEFAULT_TARGET}"
    if not port:
        return f"--target {target} has no port: give HOST:PORT, e.g. {host}:50051"
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"--target {target}: the port {port!r} is not a number from 1 to 65535"
    return None


@contextmanager
def connect(
    target: str, timeout: float, token: str = "", *, admin: bool = False
) -> Iterator[NodeClient]:
    """A `NodeClient` to ``target``; an RPC error ends the command with a message.

    A ``target`` gRPC would dial in vain (no port) ends it first, as a usage error.
    ``token`` (may be empty) goes with every call as ``authorization: Bearer``;
    a command refused for want of one says how to give it (``--admin-token``
    for an ``admin`` verb, else ``--token``).
    """
    problem = target_problem(target)
    if problem is not None:
        fail(problem, EXIT_USAGE)
    channel = grpc.insecure_channel(target)
    hint = "" if token else ADMIN_TOKEN_HINT if admin else TOKEN_HINT
    try:
        yield NodeClient(target, channel, timeout, token)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        fail(describe(exc, target, hint), exit_code(code))
    finally:
        channel.close()
