"""Cache events, handed over as data.

The block table appends events to a list as a side effect of its operations;
`Store.take_events` hands them to the caller (the service publishes them on
``WatchEvents`` and to Redis). Nothing in the core does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from kvstore.block import Block
from kvstore.types import BlockHash, NamespaceId, TenantId


class EventKind(StrEnum):
    """What happened."""

    STORED = "stored"
    """Blocks were committed and are now READY."""
    REMOVED = "removed"
    """Blocks were evicted (or cleared) and are gone."""
    CLEARED = "cleared"
    """An operator cleared the namespace."""


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """One batch of block changes in one namespace and scope."""

    kind: EventKind
    """What happened."""
    namespace: NamespaceId
    """Namespace the blocks belong to."""
    scope: TenantId
    """Tenant scope of the blocks (empty for shared namespaces)."""
    hashes: tuple[BlockHash, ...]
    """Blocks concerned, in chain order for STORED."""
    parent: BlockHash | None = None
    """For STORED: the hash before the first stored block, if any."""
    at: float = 0.0
    """`now` of the operation that produced it."""


def stored_events(namespace: NamespaceId, blocks: Iterable[Block], now: float) -> list[CacheEvent]:
    """STORED events for newly READY blocks: one per run of consecutive chain blocks.

    Each event says which hash its first block follows, so a consumer can
    rebuild the prefix tree.
    """
    events: list[CacheEvent] = []
    run: list[Block] = []
    for block in sorted(blocks, key=_depth):
        if run and (block.parent is not run[-1] or block.scope != run[-1].scope):
            events.append(_run_event(namespace, run, now))
            run = []
        run.append(block)
    if run:
        events.append(_run_event(namespace, run, now))
    return events


def removed_events(namespace: NamespaceId, blocks: Iterable[Block], now: float) -> list[CacheEvent]:
    """REMOVED events for freed blocks: one per scope."""
    by_scope: dict[TenantId, list[BlockHash]] = {}
    for block in blocks:
        by_scope.setdefault(block.scope, []).append(block.hash)
    return [
        CacheEvent(EventKind.REMOVED, namespace, scope, tuple(hashes), at=now)
        for scope, hashes in by_scope.items()
    ]


def _run_event(namespace: NamespaceId, run: list[Block], now: float) -> CacheEvent:
    first = run[0]
    return CacheEvent(
        EventKind.STORED,
        namespace,
        first.scope,
        tuple(b.hash for b in run),
        parent=first.parent.hash if first.parent is not None else None,
        at=now,
    )


def _depth(block: Block) -> int:
    return block.depth
