"""Cache events, handed over as data.

The block table appends events to a list as a side effect of its operations;
`Store.take_events` hands them to the caller (the service publishes them on
``WatchEvents`` and to Redis). Nothing in the core does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

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
