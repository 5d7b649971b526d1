"""A Lookup that may be completed from disk or a peer: look up, fill, look up again.

A lookup whose run of hits stops at an absent block first asks the node's
disk tier for the rest (`Promoter.promote`: read back into the pool, bounded
by ``disk_promote_timeout``); with ``allow_remote``, a run that still stops
at an absent block asks a peer (`PeerFetcher.fetch`). Whenever blocks
arrived, the lookup is redone against the local store. What this module
guarantees (for each fill in turn):

- The first lookup runs before the first ``await``: whatever the caller did
  just before awaiting `lookup` (a carried release) and the lookup happen
  with nothing in between.
- The first lookup's pins never leak: a fetch that is cancelled or fails
  drops them (the caller never learns of them); a fetch that brought blocks
  drops them right before the second lookup takes its own, under the same
  release id, with no ``await`` between (nothing is evicted in the gap, and
  the pin bound does not count the first pins twice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvstore.errors import KVStoreError
from kvstore.results import LookupResult, MissReason
from kvstore.types import BlockHash, LeaseId, NamespaceId, TenantId
from service.cluster.local import LocalNode


class Fetcher(Protocol):
    """What a lookup needs of peer fetch (`service.cluster.peer_fetch.PeerFetcher`)."""

    async def fetch(
        self, namespace: NamespaceId, tenant: TenantId, chain: Sequence[BlockHash], have: int
    ) -> int:
        """Copy blocks ``chain[have:]`` from the best peer; how many arrived."""


class Promotion(Protocol):
    """What a promotion did (`service.disk.promote.Promotion`)."""

    @property
    def look_again(self) -> bool:
        """Whether the pool may hold more of the chain now."""


class Promoter(Protocol):
    """What a lookup needs of the disk tier (`service.disk.promote.DiskPromoter`)."""

    async def promote(
        self, namespace: NamespaceId, tenant: TenantId, chain: Sequence[BlockHash], have: int
    ) -> Promotion:
        """Read blocks ``chain[have:]`` back from disk into the pool; what it did."""


@dataclass(frozen=True, slots=True)
class LookupCall:
    """One Lookup, checked: what the store is asked."""

    namespace: NamespaceId
    tenant: TenantId
    chain: list[BlockHash]
    query_tokens: int
    """Tokens in the query (the tenant's token counters)."""
    lease_id: LeaseId | None = None
    """Pin the hits under this lease; None: no pin."""
    release_id: int = 0
    """With a lease: the id the pins are named by (0: none)."""
    allow_remote: bool = False
    """Complete a run of hits that stops at an absent block from a peer."""


async def lookup(
    node: LocalNode, peers: Fetcher | None, call: LookupCall, disk: Promoter | None = None
) -> LookupResult:
    """The longest cached prefix of ``call.chain``, from disk and a peer too when allowed.

    Raises:
        KVStoreError: what `Store.lookup` raises (a promotion's or a peer
            fetch's failures are a miss, never an error).
    """
    result = _look_up(node, call)
    if disk is not None and result.miss_reason is MissReason.ABSENT:
        promoter = disk

        async def promoted(*args: Any) -> bool:
            return (await promoter.promote(*args)).look_again

        result = await _filled(node, call, result, promoted)
    if not call.allow_remote or peers is None or result.miss_reason is not MissReason.ABSENT:
        return result
    fetcher = peers

    async def fetched(*args: Any) -> bool:
        return await fetcher.fetch(*args) > 0

    return await _filled(node, call, result, fetched)


Fill = Callable[[NamespaceId, TenantId, Sequence[BlockHash], int], Awaitable[bool]]
"""Bring blocks ``chain[have:]`` into the pool from elsewhere; whether any may have arrived."""


async def _filled(
    node: LocalNode, call: LookupCall, result: LookupResult, fill: Fill
) -> LookupResult:
    """``result``, or the lookup redone once ``fill`` brought blocks; no pin of ``result``
    leaks either way."""
    lease_id = call.lease_id
    first = result if result.pinned and result.hashes and lease_id is not None else None
    try:
        fetched = await fill(call.namespace, call.tenant, call.chain, result.hit_blocks)
    except BaseException:
        # Cancelled (or failed) mid-fill: the caller never learns of the
        # first lookup's pins, so drop them here.
        if first is not None and lease_id is not None:
            with contextlib.suppress(KVStoreError):
                node.store.unpin_lookup(
                    call.namespace, call.tenant, lease_id, first, node.now(), call.release_id
                )
        raise
    if not fetched:
        return result
    # Blocks arrived: drop the first lookup's pins (one per block; its release
    # id unspent), then look up again (counted as a second lookup).
    if first is not None and lease_id is not None:
        node.store.unpin_lookup(
            call.namespace, call.tenant, lease_id, first, node.now(), call.release_id
        )
    return _look_up(node, call)


def _look_up(node: LocalNode, call: LookupCall) -> LookupResult:
    return node.store.lookup(
        call.namespace,
        call.tenant,
        call.chain,
        node.now(),
        lease_id=call.lease_id,
        query_tokens=call.query_tokens,
        release_id=call.release_id,
    )
