"""A Release's hashes, runs and ids: checked whole first, then applied run by run.

Shared by the ``Release`` RPC and the releases a pinned ``Lookup`` carries
(``LookupRequest.release``): both check every bound before any pin is
dropped (a bad request applies nothing), then release each run as one
`Store.release`, under its release id when the client sent ids; then the
blocks the runner found corrupt (``packed_corrupt``) go to
`Node.drop_corrupt`, which checks them itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstore.store import Store
from kvstore.types import BlockHash, LeaseId, NamespaceId, TenantId
from kvstore.v1 import kvstore_pb2 as pb
from service.api import chains
from service.api.errors import FieldError


@dataclass(frozen=True, slots=True)
class ReleasePlan:
    """A checked release: its hashes, cut into runs (None: one run), and their ids."""

    hashes: list[BlockHash]
    runs: list[int] | None
    ids: list[int]
    corrupt: list[BlockHash]
    """Blocks whose bytes the runner found not to have their checksum."""


def plan(request: pb.ReleaseRequest, max_blocks: int) -> ReleasePlan:
    """Check a release's runs, ids and hashes (bounds first, then the hashes).

    Raises:
        FieldError: bad runs (`chains.release_runs`), bad ids
            (`chains.release_ids`), bad or too many hashes.
    """
    runs = chains.release_runs(request, max_blocks) if request.runs else None
    ids = chains.release_ids(request, len(runs) if runs is not None else 1)
    limit = max_blocks * len(runs) if runs is not None else max_blocks
    corrupt = chains.corrupt_hashes(request, max_blocks)
    return ReleasePlan(chains.named_hashes(request, limit), runs, ids, corrupt)


def carried(request: pb.LookupRequest, max_blocks: int) -> ReleasePlan | None:
    """The release a Lookup carries (``LookupRequest.release``), checked; None if none.

    Its namespace and lease are the lookup's: the carried request may leave
    them empty or repeat them, never name others.

    Raises:
        FieldError: a field of ``release`` (named ``release.<field>``) is
            wrong, or the lookup names no lease to release under.
    """
    if not request.HasField("release"):
        return None
    release = request.release
    if not request.lease_id:
        raise FieldError("lease_id", "a carried release needs the lease its pins are under")
    if release.namespace_id and release.namespace_id != request.namespace_id:
        raise FieldError("release.namespace_id", "must be empty or the lookup's namespace_id")
    if release.lease_id and release.lease_id != request.lease_id:
        raise FieldError("release.lease_id", "must be empty or the lookup's lease_id")
    try:
        return plan(release, max_blocks)
    except FieldError as exc:
        raise FieldError(f"release.{exc.field}", exc.description) from None


def apply(
    store: Store,
    namespace: NamespaceId,
    tenant: TenantId,
    lease_id: LeaseId,
    checked: ReleasePlan,
    now: float,
    drop_corrupt: Callable[[NamespaceId, TenantId, list[BlockHash]], int],
) -> pb.ReleaseResponse:
    """Release each run of a checked plan, then hand its corrupt blocks to
    ``drop_corrupt`` (`Node.drop_corrupt`); the answer a ``Release`` of it gets."""
    counts = []
    start = 0
    ids = checked.ids
    for i, n in enumerate(checked.runs if checked.runs is not None else [len(checked.hashes)]):
        counts.append(
            store.release(
                namespace,
                tenant,
                lease_id,
                checked.hashes[start : start + n],
                now,
                release_id=ids[i] if ids else 0,
            )
        )
        start += n
    dropped = drop_corrupt(namespace, tenant, checked.corrupt) if checked.corrupt else 0
    if checked.runs is None:
        return pb.ReleaseResponse(released=counts[0], dropped_corrupt=dropped)
    return pb.ReleaseResponse(released=sum(counts), run_released=counts, dropped_corrupt=dropped)
