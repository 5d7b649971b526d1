"""The per-block record of the block table.

One `Block` per resident block: about 320 bytes with its dict entry and hash,
so a million blocks cost about 320 MB of metadata (measured by
``benchmarks/bench_core.py``). The record doubles as its own node in the LRU
list (`prev` / `next`), which is why it is mutable and compared by identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from kvstore.types import BlockHash, LeaseId, SlotId, TenantId


class BlockState(IntEnum):
    """Life-cycle state of a block (FREE blocks have no record at all)."""

    FREE = 0
    """Removed: the record is dead; kept alive only by a child's parent link."""
    WRITING = 1
    """Reserved by a lease that is copying the bytes in; invisible to readers."""
    READY = 2
    """Committed: readable, pinnable, evictable when unpinned."""


@dataclass(slots=True, eq=False)
class Block:
    """Metadata of one resident block. Hashable and compared by identity."""

    hash: BlockHash
    """The chained prefix hash that keys the block."""
    scope: TenantId
    """Tenant scope the block lives in (`SHARED_SCOPE` for shared namespaces)."""
    slot: SlotId
    """Slot of the namespace's pool holding the bytes."""
    generation: int
    """The slot's generation when this block took it."""
    parent: Block | None
    """Previous block of the chain (None for the first block)."""
    depth: int
    """Position in the chain: 0 for the first block."""
    state: BlockState = BlockState.WRITING
    """Current life-cycle state."""
    writer: LeaseId | None = None
    """The lease writing it, while WRITING."""
    refcount: int = 0
    """Number of pins, summed over leases; never negative."""
    hits: int = 0
    """Times a lookup returned it."""
    last_used: float = 0.0
    """`now` of the last lookup, commit or release that touched it."""
    created: float = 0.0
    """`now` when it was reserved."""
    checksum: int = 0
    """xxh3-64 of the bytes its writer wrote (`kvstore.checksum`); 0: the writer sent none."""
    lru_key: int = 0
    """Position in the namespace's eviction order (see `kvstore.eviction`)."""
    prev: Block | None = field(default=None, repr=False)
    """LRU neighbour towards the eviction end (None when not in the LRU)."""
    next: Block | None = field(default=None, repr=False)
    """LRU neighbour towards the most recently used end."""

    @property
    def orphaned(self) -> bool:
        """True when the parent was removed: no lookup can reach this block."""
        return self.parent is not None and self.parent.state is BlockState.FREE
