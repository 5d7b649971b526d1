"""Admin verbs: ``evict`` and ``clear`` (the node checks the admin token)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from kvstore.cli.common import (
    DEFAULT_TARGET,
    AdminToken,
    Json,
    NodeClient,
    Target,
    Timeout,
    connect,
    console,
    fail,
    print_json,
)
from kvstore.cli.reads import Namespace
from kvstore.ops.plural import plural
from kvstore.v1 import kvstore_pb2 as pb

Yes = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]


def confirm(question: str, yes: bool) -> None:
    """Ask ``question`` unless ``--yes``; no (or no terminal input) ends the command."""
    if yes:
        return
    try:
        answer = typer.confirm(question, default=False, err=True)
    except (typer.Abort, EOFError):
        answer = False
    if not answer:
        fail("not confirmed; nothing was changed (pass --yes to skip the question)")


@contextmanager
def confirmed_namespace(
    namespace: str, target: str, admin_token: str, timeout: float, yes: bool, question: str
) -> Iterator[tuple[NodeClient, pb.NamespaceStats]]:
    """The node and the namespace an admin verb acts on, once the operator said yes.

    The steps every admin verb on one namespace takes before its RPC: connect
    with the admin token (`connect`, whose refusal names ``--admin-token``),
    resolve ``namespace`` (an unknown or ambiguous name ends the command), then
    `confirm` ``question``, whose ``{ns}`` becomes "MODEL (NAMESPACE_ID)" and
    to which " on TARGET?" is added. An RPC error inside the block ends the command.
    """
    with connect(target, timeout, admin_token, admin=True) as node:
        ns = node.resolve_namespace(namespace)
        named = question.format(ns=f"{ns.model_id} ({ns.namespace_id})")
        confirm(f"{named} on {target}?", yes)
        yield node, ns


def report(doc: dict[str, Any], json: bool, text: str) -> None:
    """Print an admin verb's outcome: ``doc`` with ``--json``, else the line ``text``."""
    if json:
        print_json(doc)
    else:
        console.print(text)


def evict(
    namespace: Namespace,
    blocks: Annotated[int, typer.Option(min=1, help="How many unpinned blocks to evict.")],
    target: Target = DEFAULT_TARGET,
    admin_token: AdminToken = "",
    json: Json = False,
    timeout: Timeout = 5.0,
    yes: Yes = False,
) -> None:
    """Evict up to --blocks unpinned blocks, least recently used first (admin)."""
    question = f"Evict up to {plural(blocks, 'block')} of {{ns}}"
    with confirmed_namespace(namespace, target, admin_token, timeout, yes, question) as (node, ns):
        resp = node.stub.Evict(
            pb.EvictRequest(namespace_id=ns.namespace_id, blocks=blocks),
            timeout=timeout,
            metadata=node.metadata,
        )
    report(
        {"namespace": ns.namespace_id, "evicted": resp.evicted},
        json,
        f"evicted {plural(resp.evicted, 'block')} of {ns.namespace_id}",
    )


def clear(
    namespace: Namespace,
    target: Target = DEFAULT_TARGET,
    admin_token: AdminToken = "",
    json: Json = False,
    timeout: Timeout = 5.0,
    yes: Yes = False,
) -> None:
    """Remove every unpinned block of a namespace (admin)."""
    with confirmed_namespace(
        namespace, target, admin_token, timeout, yes, "Clear every unpinned block of {ns}"
    ) as (node, ns):
        resp = node.stub.Clear(
            pb.ClearRequest(namespace_id=ns.namespace_id), timeout=timeout, metadata=node.metadata
        )
    report(
        {
            "namespace": ns.namespace_id,
            "removed": resp.removed,
            "kept_pinned": resp.kept_pinned,
            "kept_writing": resp.kept_writing,
        },
        json,
        f"removed {plural(resp.removed, 'block')} of {ns.namespace_id}; "
        f"kept {resp.kept_pinned} pinned and {resp.kept_writing} being written",
    )


__all__ = ["clear", "evict"]


COMMANDS = (evict, clear)
"""The subcommands of this module, in help order; `kvstore.cli.app` registers them."""
