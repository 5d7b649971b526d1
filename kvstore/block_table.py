"""The block table of one namespace: hash → slot, states, pins, LRU, eviction.

Invariants (checked by ``tests/kvstore/test_store_state_machine.py`` after
every step of random interleavings):

- ``free + quarantined + ready + writing == capacity``; a slot belongs to at
  most one block (the counts, slots, LRU and quotas are kept by
  `kvstore.residency`). The WRITING slots of an expired lease are
  quarantined, never handed out again before their release time.
- Every READY block with no pins is in the LRU; pinned blocks may stay in it
  (a pin is a count, not an LRU operation) but are never evicted; WRITING
  blocks are never returned by a lookup.
- Recency order is consistent with the prefix tree: a block in the LRU is
  always more recently used than every descendant of it in the LRU, because
  each touch moves the touched blocks *and their ancestors* to the most
  recent end, deepest first. So the LRU's eviction end is always a leaf and
  chains are evicted from their tails: leaves before parents.
- A block whose parent was removed can no longer be reached by any lookup
  (its hash chains through the parent): when it enters the LRU it goes to
  the eviction end, so it is reclaimed before anything else.
- The LRU is kept per tenant scope (`kvstore.eviction.ScopedLRU`); the
  order above holds inside each scope, and the node-wide victim is the best
  head over the scopes. With a quota, a scope never holds more than its
  ``max_blocks`` resident blocks: at its quota a reservation evicts the
  scope's own least recently used block, or gets NO_ROOM, so a tenant at
  quota never evicts another tenant's blocks.

Pins and writes are recorded in the lease as well as in the block, so ending
a lease costs O(what it holds).

Over 400 lines on purpose: one concept, the block life cycle as leases drive it,
checked whole by the state-machine test (slots, LRU, counts, quotas, stamps:
`kvstore.residency`; per-block loops: `kvstore.pins`, `kvstore.reserve_walk`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvstore.block import Block, BlockState
from kvstore.errors import FailedPrecondition, InvalidArgument, LimitExceeded, NotWriter, StaleSlot
from kvstore.events import CacheEvent, EventKind, removed_events, stored_events
from kvstore.layout import NamespaceSpec
from kvstore.lease import Lease
from kvstore.pins import keep_checksums, lookup_result, pin_run, unpin_hashes, walk
from kvstore.reserve_walk import reserve_walk
from kvstore.residency import Residency
from kvstore.results import (
    BlockInfo,
    BlockRef,
    ClearReport,
    LookupResult,
    NamespaceStats,
    QuotaOf,
    ReserveResult,
)
from kvstore.stamps import GenerationCounter, StampSink
from kvstore.tenant_counters import TenantCounterBook
from kvstore.types import SHARED_SCOPE, BlockHash, SlotId, TenantId, check_hashes


class BlockTable:
    """All blocks of one namespace and the slots of its pool."""

    def __init__(
        self,
        spec: NamespaceSpec,
        capacity: int,
        *,
        shared: bool = False,
        events: list[CacheEvent] | None = None,
        max_pins_per_lease: int = 0,
        quota: QuotaOf | None = None,
        max_tenant_counters: int = 0,
        generations: GenerationCounter | None = None,
        stamps: StampSink | None = None,
    ) -> None:
        """Create an empty table.

        Args:
            spec: the namespace (model, layout, scheme).
            capacity: number of slots in the pool; never exceeded.
            shared: when True all tenants share one scope (operator's choice).
            events: list to append events to (the store's); a private one if None.
            max_pins_per_lease: bound on one lease's pins (0 = unbounded).
            quota: scope → most resident blocks it may hold (0 = none); asked per new block.
            max_tenant_counters: tenants with counters of their own (`kvstore.tenant_counters`).
            generations, stamps: the node's counter; the pool's stamp table (`kvstore.stamps`).
        """
        if capacity <= 0:
            raise InvalidArgument(f"capacity must be a positive number of blocks, got {capacity}")
        self.spec = spec
        self.namespace = spec.namespace_id
        self.capacity = capacity
        self.shared = shared
        self.block_size = spec.layout.block_size
        self.max_pins_per_lease = max_pins_per_lease
        self._events = events if events is not None else []
        self._res = Residency(capacity, quota, generations, stamps)
        self._counters = TenantCounterBook(max_tenant_counters)

    # --- queries -------------------------------------------------------------

    def scope_of(self, tenant: TenantId) -> TenantId:
        """The scope a tenant's blocks live in."""
        return SHARED_SCOPE if self.shared else tenant

    def __len__(self) -> int:
        """Resident blocks (READY or WRITING)."""
        return self._res.resident()

    def generation(self, slot: SlotId) -> int:
        """Current generation of a slot."""
        return self._res.generation(slot)

    def stamp_of(self, slot: SlotId) -> tuple[int, int]:
        """A slot's (generation, ident) as runners read it; (0, 0) out of range."""
        return self._res.stamp_of(slot) if 0 <= slot < self.capacity else (0, 0)

    def ready_ref(self, scope: TenantId, block_hash: BlockHash) -> BlockRef | None:
        """Where a READY block of ``scope`` lies (slot, generation, checksum); else None."""
        b = self._res.find(scope, block_hash)
        ready = b is not None and b.state is BlockState.READY
        return BlockRef(b.hash, b.slot, b.generation, b.checksum) if b and ready else None

    def check_slot(self, tenant: TenantId, ref: BlockRef) -> Block:
        """The READY or WRITING block that ``ref`` names, or `StaleSlot`.

        Used by the byte-streaming RPCs to make sure a slot is still what the
        caller thinks it is before reading or writing it.
        """
        block = self._res.find(self.scope_of(tenant), ref.hash)
        if block is None or block.slot != ref.slot or block.generation != ref.generation:
            raise StaleSlot(
                f"slot {ref.slot} generation {ref.generation} no longer holds block "
                f"{ref.hash.hex()[:16]}"
            )
        return block

    def pinned_slot(self, lease: Lease, ref: BlockRef) -> SlotId:
        """The slot of a READY block that ``lease`` pins, for reading its bytes.

        Raises:
            StaleSlot: ``ref`` no longer names the block it was issued for.
            FailedPrecondition: the block is not pinned under this lease.
        """
        block = self.check_slot(lease.tenant, ref)
        if block.state is not BlockState.READY or block not in lease.pins.get(self.namespace, ()):
            raise FailedPrecondition(
                f"block {ref.hash.hex()[:16]} is not pinned under lease {lease.lease_id}; "
                "pin it with a lookup first"
            )
        return block.slot

    def writing_slot(self, lease: Lease, block_hash: BlockHash) -> SlotId:
        """The slot of a block WRITING under ``lease``, for writing its bytes.

        Raises:
            NotWriter: the block is not reserved under this lease (never
                reserved, aborted, committed, or the lease expired).
        """
        block = self._res.find(self.scope_of(lease.tenant), block_hash)
        if block is None or block not in lease.writes.get(self.namespace, ()):
            raise NotWriter(
                f"block {block_hash.hex()[:16]} is not reserved under lease {lease.lease_id} "
                "(reserve it first; it may have been aborted or its lease expired)"
            )
        return block.slot

    # --- lookup ----------------------------------------------------------------

    def lookup(
        self,
        tenant: TenantId,
        chain: Sequence[BlockHash],
        now: float,
        *,
        lease: Lease | None = None,
        query_tokens: int | None = None,
        peek: bool = False,
    ) -> LookupResult:
        """Longest run of READY blocks from the start of ``chain``.

        With ``lease`` the hits are pinned under it in the same step, so no
        eviction can slip between "found" and "pinned". A pin moves nothing
        in the LRU; the release that follows touches the chain once.

        Args:
            tenant: the caller's tenant.
            chain: block hashes from the first block of the prompt on.
            now: current time.
            lease: pin the hits under this lease (must belong to ``tenant``).
            query_tokens: tokens of the whole query, for token accounting
                (defaults to ``len(chain) * block_size``).
            peek: leave no trace: no hit counters, no ``last_used``, no LRU
                move (a peer node's read is not the tenant's use of its cache).
        """
        hits, reason = walk(self._res.blocks(self.scope_of(tenant)), chain)
        if lease is not None and hits:
            self._check_pin_bound(lease, len(hits))
            pin_run(self._res, lease, self.namespace, hits, None if peek else now)
            lease.pin_total += len(hits)
        if not peek:
            if lease is None:
                for block in hits:
                    block.hits += 1
                self._res.touch_prefix(hits, now)
            self._counters.of(tenant).count_lookup(
                len(chain), len(hits), reason, self.block_size, query_tokens
            )
        return lookup_result(chain, hits, lease is not None, reason)

    # --- write path --------------------------------------------------------

    def reserve(self, lease: Lease, chain: Sequence[BlockHash], now: float) -> ReserveResult:
        """Allocate slots for the blocks of ``chain`` that nobody has.

        Per block, in order: READY → HIT; WRITING under another lease →
        IN_FLIGHT; WRITING under this lease → RESERVED again (idempotent);
        absent → a free slot, or the least recently used evictable block's
        slot, or NO_ROOM for it and every later block. A scope at its quota
        takes the slot of its own least recently used evictable block, or
        gets NO_ROOM: it never evicts another scope's blocks. Blocks of the chain
        that are hits are protected from eviction for the duration of the
        call, so reserving a tail never evicts its own prefix.
        """
        check_hashes(chain)
        removed: list[Block] = []
        try:
            return reserve_walk(
                self._res,
                lease,
                lease.writes_in(self.namespace),
                self.scope_of(lease.tenant),
                chain,
                now,
                removed,
            )
        finally:
            self._emit_removed(removed, now)

    def commit(
        self, lease: Lease, hashes: Sequence[BlockHash], now: float, checksums: Sequence[int] = ()
    ) -> int:
        """Make blocks this lease wrote READY; returns how many changed state.

        The call is validated whole before anything changes: a hash that is
        not WRITING under this lease raises `NotWriter` and commits nothing.
        A hash already READY is accepted (a retried commit) and not counted;
        ``checksums[i]`` is kept with ``hashes[i]``'s block.
        """
        check_hashes(hashes)
        blocks = self._res.blocks(self.scope_of(lease.tenant))
        writes = lease.writes_in(self.namespace)
        todo: list[Block] = []
        for h in hashes:
            block = blocks.get(h)
            if block is not None and block.state is BlockState.WRITING and block in writes:
                todo.append(block)
            elif block is None or block.state is not BlockState.READY:
                raise NotWriter(
                    f"block {h.hex()[:16]} is not being written under lease {lease.lease_id}"
                    " (never reserved, aborted, or the lease expired)"
                )
        todo = list(dict.fromkeys(todo))
        if not todo:
            return 0
        keep_checksums(blocks, hashes, checksums)
        self._res.mark_ready(todo, now)
        for block in todo:
            writes.discard(block)
        counters = self._counters.of(lease.tenant)
        counters.stored_blocks += len(todo)
        self._res.touch(todo, now)
        self._emit_stored(todo, now)
        return len(todo)

    def abort(self, lease: Lease, hashes: Sequence[BlockHash], now: float) -> int:
        """Free blocks this lease reserved and will not write; returns how many.

        Hashes that are not WRITING under this lease are ignored (they may
        have been aborted already, or freed with an expired lease).
        """
        check_hashes(hashes)
        blocks = self._res.blocks(self.scope_of(lease.tenant))
        writes = lease.writes_in(self.namespace)
        freed = 0
        for h in hashes:
            block = blocks.get(h)
            if block is not None and block in writes:
                writes.discard(block)
                self._res.drop_writing(block)
                freed += 1
        return freed

    # --- pins ----------------------------------------------------------------

    def release(self, lease: Lease, hashes: Sequence[BlockHash], now: float) -> int:
        """Drop one of this lease's pins on each named block; returns how many.

        A block this lease does not pin (never pinned, or already released)
        is skipped: a release never touches another lease's pins and never
        drives a count below zero.
        """
        blocks = self._res.blocks(self.scope_of(lease.tenant))
        released, prefix = unpin_hashes(self._res, lease, self.namespace, blocks, hashes)
        lease.pin_total -= len(released)
        if prefix:
            self._res.touch_prefix(released, now)
        else:
            self._res.touch(released, now)
        return len(released)

    def drop_lease(self, lease: Lease, now: float, until: float | None = None) -> tuple[int, int]:
        """Release every pin and abort every write of a lease in this namespace.

        With ``until`` (the lease expired: its writer may be stalled, not dead)
        the slots of its writes are quarantined until then instead of freed.

        Returns:
            (pins dropped, writes aborted). Cost: O(what the lease holds here).
        """
        pins = lease.pins.pop(self.namespace, set())
        extra = lease.extra_pins.pop(self.namespace, {})
        released: list[Block] = []
        dropped = 0
        for block in pins:
            count = 1 + extra.get(block, 0)
            for _ in range(count):
                self._res.unpin(block)
            dropped += count
            released.append(block)
        lease.pin_total -= dropped
        self._res.touch(released, now)
        writes = lease.writes.pop(self.namespace, set())
        for block in writes:
            self._res.drop_writing(block, until)
        return dropped, len(writes)

    def release_quarantined(self, now: float) -> int:
        """Free the quarantined slots whose release time has come; returns how many."""
        return self._res.release_due(now)

    # --- eviction -------------------------------------------------------------

    def evict(self, n: int, now: float) -> int:
        """Evict up to ``n`` unpinned READY blocks, leaves first; returns how many."""
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of blocks ({n})")
        removed = self._res.evict(n)
        self._emit_removed(removed, now)
        return len(removed)

    def drop_corrupt(self, tenant: TenantId, block_hash: BlockHash, now: float) -> bool:
        """Remove a READY block whose bytes failed their checksum, unless it is pinned.

        The caller checked the bytes (`Node.drop_corrupt`); a pinned block
        stays: its readers check it in turn, and the last one's report drops it.
        """
        block = self._res.find(self.scope_of(tenant), block_hash)
        if block is None or not self._res.drop_unpinned(block):
            return False
        self._emit_removed([block], now)
        return True

    def clear(self, now: float) -> ClearReport:
        """Remove every READY unpinned block; pinned and WRITING blocks stay.

        Pinned blocks are in use by a runner that has their memory mapped;
        once released they stay cached like any other block (a second clear,
        or eviction, removes them). Returns what was removed and kept.
        """
        removed = self._res.clear()
        self._emit_removed(removed, now)
        self._events.append(CacheEvent(EventKind.CLEARED, self.namespace, SHARED_SCOPE, (), at=now))
        return ClearReport(
            removed=len(removed), kept_pinned=self._res.pinned, kept_writing=self._res.writing
        )

    # --- capacity: the node adds and gives back whole arenas at the pool's end ---

    def shortfall(self, tenant: TenantId, chain: Sequence[BlockHash]) -> int:
        """Blocks of ``chain`` not resident for ``tenant``, beyond the free slots."""
        return self._res.shortfall(self.scope_of(tenant), chain)

    def resize(self, delta: int, now: float) -> bool:
        """Add ``delta`` slots or retire the last ``-delta`` (`Residency.resize`)."""
        self._res.release_due(now)  # a slot whose quarantine is over may go
        removed: list[Block] = []
        if not self._res.resize(delta, removed, now):
            return False
        self.capacity = self._res.capacity
        self._emit_removed(removed, now)
        return True

    # --- inspection -----------------------------------------------------------

    @property
    def free_slots(self) -> int:
        """Slots that hold no block and are not quarantined: a reserve takes these first."""
        return self._res.free

    def resident(self, scope: TenantId | None = None) -> int:
        """Resident blocks (READY or WRITING) of one scope, or of all."""
        return self._res.resident(scope)

    def iter_blocks(self, scope: TenantId | None = None) -> Iterator[BlockInfo]:
        """Snapshot of every resident block (of one scope if given), scope by scope."""
        return self._res.iter_blocks(scope)

    def lru_order(self) -> list[BlockHash]:
        """Hashes of evictable blocks, next victim first (for tests and tools)."""
        return self._res.lru_order()

    def quarantine_snapshot(self) -> list[tuple[float, SlotId]]:
        """(release time, slot) of every quarantined slot, oldest first (for tests and tools)."""
        return self._res.quarantine_snapshot()

    def stats(self) -> NamespaceStats:
        """Occupancy and per-tenant counters (copies)."""
        res = self._res
        free = res.free
        return NamespaceStats(
            namespace=self.namespace,
            model_id=self.spec.model_id,
            block_size=self.block_size,
            block_bytes=self.spec.layout.block_bytes,
            capacity=self.capacity,
            free=free,
            ready=self.capacity - free - res.quarantined - res.writing,
            quarantined=res.quarantined,
            writing=res.writing,
            pinned=res.pinned,
            evictable=res.evictable,
            evictions=res.evictions,
            tenants=self._counters.copies(),
            resident_by_tenant=self._counters.fold(res.resident_by_scope()),
        )

    # --- internals --------------------------------------------------------------

    def _check_pin_bound(self, lease: Lease, more: int) -> None:
        limit = self.max_pins_per_lease
        if limit and lease.pin_total + more > limit:
            raise LimitExceeded(
                f"lease {lease.lease_id} would hold {lease.pin_total + more} pins, over the "
                f"limit of {limit}; release blocks you no longer read"
            )

    def _emit_stored(self, blocks: list[Block], now: float) -> None:
        self._events.extend(stored_events(self.namespace, blocks, now))

    def _emit_removed(self, removed: list[Block], now: float) -> None:
        self._events.extend(removed_events(self.namespace, removed, now))
