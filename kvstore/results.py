"""Results the store returns: frozen value objects, no live references.

The service turns these into protobuf messages; tests assert on them. They
never expose `Block` records, so callers cannot mutate the table. A lookup's
hits come as arrays (`LookupResult.slots`, ``.generations``) and the hashes'
tuple, not as one object per block.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from kvstore.block import BlockState
from kvstore.types import BlockHash, LeaseId, NamespaceId, SlotId, TenantId

QuotaOf = Callable[[TenantId], int]
"""Scope → most resident blocks it may hold in a namespace (0 = no quota)."""


@dataclass(frozen=True, slots=True)
class BlockRef:
    """Where one block's bytes live: a slot and the generation it had."""

    hash: BlockHash
    """The block's chained hash."""
    slot: SlotId
    """Slot in the namespace's pool."""
    generation: int
    """Slot generation; a different current generation means the slot was reused."""
    checksum: int = 0
    """Checksum of the bytes its writer wrote (`kvstore.checksum`); 0: none was sent."""


class MissReason(IntEnum):
    """Why a lookup stopped where it did."""

    NONE = 0
    """Every block of the chain was a hit."""
    ABSENT = 1
    """The next block is not cached (never stored, evicted or cleared)."""
    IN_FLIGHT = 2
    """The next block is being written by some lease; retry shortly."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest READY prefix of a chain, as arrays (no object per block).

    ``hashes[i]``, ``slots[i]``, ``generations[i]`` and ``checksums[i]`` describe the i-th hit;
    `blocks` builds the same as `BlockRef` objects on first use, for callers
    that want them (a 512-block lookup need not pay 512 objects).
    """

    hashes: Sequence[BlockHash]
    """Hashes of the hit blocks, from the first block of the chain on."""
    slots: array[int]
    """Their slots (``array('q')``)."""
    generations: array[int]
    """Their slot generations (``array('Q')``)."""
    checksums: array[int]
    """Their writers' checksums (``array('Q')``, 0 where none was sent)."""
    pinned: bool
    """True when the hits are pinned under the caller's lease."""
    miss_reason: MissReason
    """Why the run of hits ended."""
    _refs: list[tuple[BlockRef, ...]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    @property
    def hit_blocks(self) -> int:
        """Number of leading blocks found READY."""
        return len(self.slots)

    @property
    def blocks(self) -> tuple[BlockRef, ...]:
        """The hits as `BlockRef` objects (built once, on first use)."""
        if not self._refs:
            self._refs.append(
                tuple(
                    map(
                        BlockRef,  # type: ignore[arg-type]
                        self.hashes,
                        self.slots,
                        self.generations,
                        self.checksums,
                    )
                )
            )
        return self._refs[0]


class ReserveStatus(IntEnum):
    """Outcome of `reserve` for one block of the chain."""

    HIT = 0
    """Already READY: nothing to write."""
    IN_FLIGHT = 1
    """Another lease is writing it: do not write, it will appear."""
    RESERVED = 2
    """A slot is yours to write, then commit or abort."""
    NO_ROOM = 3
    """No free or evictable slot; later blocks are NO_ROOM too."""


@dataclass(frozen=True, slots=True)
class ReserveEntry:
    """One block of a reservation."""

    hash: BlockHash
    """The block's chained hash."""
    status: ReserveStatus
    """What happened to it."""
    slot: SlotId | None = None
    """For RESERVED (and HIT): its slot."""
    generation: int = 0
    """The slot's generation for RESERVED and HIT."""


class ReserveResult:
    """Per-block outcome of a reservation, in chain order, as parallel lists.

    Block i is ``hashes[i]`` with ``statuses[i]``; ``slots[i]`` and
    ``generations[i]`` are its slot and the slot's generation for RESERVED
    and HIT (0 otherwise). `entries` builds one `ReserveEntry` per block,
    on demand: a long chain's reply is built from the lists.
    """

    __slots__ = ("_entries", "generations", "hashes", "slots", "statuses")

    def __init__(
        self,
        hashes: Sequence[BlockHash],
        statuses: list[ReserveStatus],
        slots: list[int],
        generations: list[int],
    ) -> None:
        if not len(hashes) == len(statuses) == len(slots) == len(generations):
            raise ValueError("bug: reservation lists of different lengths")
        self.hashes = hashes
        self.statuses = statuses
        self.slots = slots
        self.generations = generations
        self._entries: tuple[ReserveEntry, ...] | None = None

    @property
    def entries(self) -> tuple[ReserveEntry, ...]:
        """One entry per block of the chain (built once, on first use)."""
        if self._entries is None:
            placed = (ReserveStatus.RESERVED, ReserveStatus.HIT)
            self._entries = tuple(
                ReserveEntry(h, st, SlotId(sl), g) if st in placed else ReserveEntry(h, st)
                for h, st, sl, g in zip(
                    self.hashes, self.statuses, self.slots, self.generations, strict=True
                )
            )
        return self._entries

    @property
    def reserved(self) -> tuple[ReserveEntry, ...]:
        """The entries whose slots the caller must write and commit."""
        return tuple(e for e in self.entries if e.status is ReserveStatus.RESERVED)

    def reserved_hashes(self) -> list[BlockHash]:
        """The hashes of the RESERVED blocks, in chain order."""
        reserved = ReserveStatus.RESERVED
        return [h for h, st in zip(self.hashes, self.statuses, strict=True) if st is reserved]

    @property
    def complete(self) -> bool:
        """True when no block came back NO_ROOM."""
        return ReserveStatus.NO_ROOM not in self.statuses


@dataclass(frozen=True, slots=True)
class ReleaseReport:
    """What ending a lease (expiry or close) freed."""

    lease_id: LeaseId
    """The lease that ended."""
    tenant: TenantId
    """Its tenant."""
    pins_dropped: int
    """Pins released, counting repeats."""
    writes_aborted: int
    """WRITING blocks freed."""


@dataclass(frozen=True, slots=True)
class ClearReport:
    """What `clear` removed and what it had to leave."""

    removed: int
    """READY unpinned blocks removed."""
    kept_pinned: int
    """Pinned blocks left in place (they go when released)."""
    kept_writing: int
    """WRITING blocks left in place (they go when committed or aborted)."""


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """A read-only snapshot of one block for inspection tools."""

    hash: BlockHash
    """The block's chained hash."""
    parent: BlockHash | None
    """The previous block's hash (None at depth 0)."""
    scope: TenantId
    """Tenant scope."""
    slot: SlotId
    """Slot in the pool."""
    generation: int
    """Slot generation."""
    state: BlockState
    """WRITING or READY."""
    refcount: int
    """Pins, summed over leases."""
    hits: int
    """Lookups that returned it."""
    depth: int
    """Position in its chain."""
    created: float
    """When it was reserved."""
    last_used: float
    """Last lookup, commit or release that touched it."""


@dataclass(slots=True)
class TenantCounters:
    """Cumulative lookup accounting for one tenant in one namespace."""

    lookups: int = 0
    """Lookup calls."""
    hit_blocks: int = 0
    """Blocks returned as hits."""
    miss_blocks: int = 0
    """Full blocks asked for and not found."""
    hit_tokens: int = 0
    """Tokens covered by hit blocks."""
    miss_tokens: int = 0
    """Tokens of the query not covered by hits (partial last block included)."""
    miss_absent: int = 0
    """Lookups that stopped on an absent block."""
    miss_in_flight: int = 0
    """Lookups that stopped on a block being written."""
    stored_blocks: int = 0
    """Blocks this tenant committed."""

    def count_lookup(
        self, asked: int, hit: int, reason: MissReason, block_size: int, query_tokens: int | None
    ) -> None:
        """Account one lookup of ``asked`` blocks that found ``hit``."""
        self.lookups += 1
        self.hit_blocks += hit
        self.miss_blocks += asked - hit
        hit_tokens = hit * block_size
        total = query_tokens if query_tokens is not None else asked * block_size
        self.hit_tokens += hit_tokens
        self.miss_tokens += max(0, total - hit_tokens)
        if reason is MissReason.ABSENT:
            self.miss_absent += 1
        elif reason is MissReason.IN_FLIGHT:
            self.miss_in_flight += 1


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    """Occupancy and hit accounting of one namespace."""

    namespace: NamespaceId
    """Namespace id."""
    model_id: str
    """Its model id."""
    block_size: int
    """Tokens per block."""
    block_bytes: int
    """Bytes per block."""
    capacity: int
    """Slots in its pool."""
    free: int
    """Slots holding nothing, ready to be reused."""
    ready: int
    """READY blocks."""
    writing: int
    """WRITING blocks."""
    pinned: int
    """Blocks with at least one pin."""
    evictable: int
    """READY unpinned blocks (in the LRU)."""
    evictions: int
    """Blocks evicted so far to make room (not counting clears)."""
    tenants: dict[TenantId, TenantCounters]
    """Per-tenant counters (copies)."""
    resident_by_tenant: dict[TenantId, int]
    """Blocks (READY or WRITING) per tenant scope."""
    quarantined: int = 0
    """Slots of writers whose lease expired, not reused before their release time."""


@dataclass(frozen=True, slots=True)
class ExpiryReport:
    """What one `Store.expire` call freed."""

    leases: tuple[ReleaseReport, ...]
    """One report per expired lease."""

    @property
    def pins_dropped(self) -> int:
        """Pins dropped over all expired leases."""
        return sum(r.pins_dropped for r in self.leases)

    @property
    def writes_aborted(self) -> int:
        """WRITING blocks freed over all expired leases."""
        return sum(r.writes_aborted for r in self.leases)
