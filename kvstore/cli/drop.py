"""``kvstore drop``: remove a namespace, its blocks and its pool (admin).

The node refuses (exit 1, FAILED_PRECONDITION) while a block of the
namespace is pinned or being written; ``--force`` takes the pins from their
leases and aborts the writes. The pool's memory returns to the node's budget
and the same model may be registered again.
"""

from __future__ import annotations

from typing import Annotated

import typer

from kvstore.cli.admin import Yes, confirmed_namespace, report
from kvstore.cli.common import DEFAULT_TARGET, AdminToken, Json, Target, Timeout
from kvstore.cli.reads import Namespace
from kvstore.ops.plural import plural
from kvstore.v1 import kvstore_pb2 as pb

Force = Annotated[
    bool,
    typer.Option(
        "--force", help="Drop even while runners pin or write blocks (their pins are lost)."
    ),
]


def drop(
    namespace: Namespace,
    force: Force = False,
    target: Target = DEFAULT_TARGET,
    admin_token: AdminToken = "",
    json: Json = False,
    timeout: Timeout = 5.0,
    yes: Yes = False,
) -> None:
    """Remove a namespace and free its pool (admin); refused while in use unless --force."""
    how = " by force" if force else ""
    with confirmed_namespace(
        namespace, target, admin_token, timeout, yes, f"Drop namespace {{ns}}{how}"
    ) as (node, ns):
        resp = node.stub.DropNamespace(
            pb.DropNamespaceRequest(namespace_id=ns.namespace_id, force=force),
            timeout=timeout,
            metadata=node.metadata,
        )
    report(
        {
            "namespace": ns.namespace_id,
            "removed": resp.removed,
            "pins_dropped": resp.pins_dropped,
            "writes_aborted": resp.writes_aborted,
            "freed_bytes": resp.freed_bytes,
        },
        json,
        f"dropped {ns.namespace_id} ({ns.model_id}): {plural(resp.removed, 'block')} removed, "
        f"{plural(resp.pins_dropped, 'pin')} dropped, "
        f"{plural(resp.writes_aborted, 'write')} aborted, "
        f"{plural(resp.freed_bytes, 'byte')} freed",
    )


__all__ = ["drop"]


COMMANDS = (drop,)
"""The subcommands of this module; `kvstore.cli.app` registers them."""
