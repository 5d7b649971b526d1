"""The resident blocks of one namespace's pool: where they are, what they hold, who goes next.

`Residency` owns the bookkeeping below the block table's protocol: the
blocks of each tenant scope by hash, the slot allocator, the per-scope LRU
of evictable blocks, the pin and WRITING counts and the scope quotas. The
block table (`kvstore.block_table`) decides *what* happens to a lease's
blocks; this module carries the state changes out and keeps the counts
true:

- ``free + quarantined + ready + writing == capacity``; a slot belongs to at
  most one block. A quarantined slot (taken from a writer whose lease
  expired) is never allocated before its release time, and only once no
  ordinary free slot is left (`kvstore.slots`).
- Every READY block with no pins is in the LRU; a pinned block may be in it
  too (a pin does not unlink it), but eviction never picks one
  (`kvstore.eviction`).
- With a quota, a scope never holds more than its ``max_blocks`` resident
  blocks: at its quota an allocation evicts the scope's own least recently
  used block, or fails, so a tenant at quota never evicts another's blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

from kvstore.block import Block, BlockState
from kvstore.eviction import ScopedLRU
from kvstore.results import BlockInfo, QuotaOf
from kvstore.slots import SlotAllocator
from kvstore.stamps import GenerationCounter, StampSink, stamp_ident
from kvstore.types import BlockHash, SlotId, TenantId


class Residency:
    """Scope maps, slots, LRU, pin and WRITING counts of one namespace's pool."""

    def __init__(
        self,
        capacity: int,
        quota: QuotaOf | None,
        generations: GenerationCounter | None = None,
        stamps: StampSink | None = None,
    ) -> None:
        """Empty residency of ``capacity`` slots; the arguments as in `BlockTable`."""
        self.capacity = capacity
        self.writing = 0
        """Blocks in state WRITING."""
        self.pinned = 0
        """READY blocks with at least one pin."""
        self.evictions = 0
        """Blocks evicted to make room (clear and abort are not evictions)."""
        self._scopes: dict[TenantId, dict[BlockHash, Block]] = {}
        self._slots = SlotAllocator(capacity, generations, stamps)
        self._lru = ScopedLRU()
        self._quota = quota
        self._resident: dict[TenantId, int] = {}

    # --- lookups ------------------------------------------------------------------

    @property
    def free(self) -> int:
        """Free slots."""
        return self._slots.free

    @property
    def quarantined(self) -> int:
        """Slots of expired writers waiting for their release time."""
        return self._slots.quarantined

    @property
    def evictable(self) -> int:
        """READY blocks without pins (every one of them is in the LRU)."""
        return self.resident() - self.writing - self.pinned

    def generation(self, slot: SlotId) -> int:
        """Current generation of a slot."""
        return self._slots.generation(slot)

    def stamp_of(self, slot: SlotId) -> tuple[int, int]:
        """The (generation, ident) stamp of a slot, as runners read it."""
        return self._slots.stamp_of(slot)

    def hand_to_writer(self, slot: SlotId) -> int:
        """Stamp a slot `allocate` gave as WRITING (a new generation, ident 0); returns it.

        Before the writer hears of the slot: a reader still holding the
        slot's old stamp sees it move before any byte of it is rewritten.
        """
        return self._slots.restamp(slot)

    def blocks(self, scope: TenantId) -> dict[BlockHash, Block]:
        """The blocks of ``scope`` by hash (read only: change them through this class)."""
        return self._scopes.get(scope, {})

    def find(self, scope: TenantId, block_hash: BlockHash) -> Block | None:
        """The resident block of ``scope`` with that hash, if any."""
        return self._scopes.get(scope, {}).get(block_hash)

    def resident(self, scope: TenantId | None = None) -> int:
        """Resident blocks (READY or WRITING) of one scope, or of all."""
        if scope is None:
            return self.capacity - self._slots.free - self._slots.quarantined
        return self._resident.get(scope, 0)

    def resident_by_scope(self) -> dict[TenantId, int]:
        """Resident blocks per scope (a copy)."""
        return dict(self._resident)

    def quota_of(self, scope: TenantId) -> int:
        """Most blocks ``scope`` may hold here (0 = no quota)."""
        return self._quota(scope) if self._quota is not None else 0

    def iter_blocks(self, scope: TenantId | None = None) -> Iterator[BlockInfo]:
        """Snapshot of every resident block (of one scope if given), scope by scope."""
        groups = list(self._scopes.values()) if scope is None else [self._scopes.get(scope, {})]
        for scope_blocks in groups:
            for b in list(scope_blocks.values()):
                yield BlockInfo(
                    hash=b.hash,
                    parent=b.parent.hash if b.parent is not None else None,
                    scope=b.scope,
                    slot=b.slot,
                    generation=b.generation,
                    state=b.state,
                    refcount=b.refcount,
                    hits=b.hits,
                    depth=b.depth,
                    created=b.created,
                    last_used=b.last_used,
                )

    def lru_order(self) -> list[BlockHash]:
        """Hashes of evictable blocks, next victim first."""
        return [b.hash for b in self._lru.evictable()]

    # --- pins and recency ----------------------------------------------------------

    def pin(self, block: Block) -> None:
        """Add a pin (the block stays where it is in the LRU; eviction skips it)."""
        if block.refcount == 0:
            self.pinned += 1
        block.refcount += 1

    def unpin(self, block: Block) -> None:
        """Drop a pin; the block re-enters the LRU on its next `touch`."""
        if block.refcount <= 0:
            raise RuntimeError(f"bug: unpinning block {block.hash.hex()[:16]} with no pins")
        block.refcount -= 1
        if block.refcount == 0:
            self.pinned -= 1

    def touch_prefix(self, run: list[Block], now: float) -> None:
        """A run from depth 0 (each block the next one's parent): most recently used at ``now``.

        One pass, no ancestor walk (`ScopedLRU.touch_prefix`).
        """
        self._lru.touch_prefix(run, now)

    def touch(self, touched: Iterable[Block], now: float) -> None:
        """Move blocks and their ancestors to the recently used end (`ScopedLRU.touch`).

        A chain's run of READY blocks whose ancestors are all READY (a
        commit, a reservation's hits) is the prefix case: one
        `touch_prefix` pass over the ancestors and the run, no dict, no sort.
        """
        run = touched if isinstance(touched, list) else list(touched)
        prefix = _with_ancestors(run)
        if prefix is not None:
            self._lru.touch_prefix(prefix, now)
        else:
            self._lru.touch(run, now, self._relink)

    def _relink(self, block: Block) -> None:
        """Point ``block`` at the live record of its parent's hash, if one exists.

        A parent that was removed and later stored again is a new record; the
        child's hash still chains through it, so the child is reachable again.
        """
        parent = block.parent
        if parent is not None and parent.state is BlockState.FREE:
            live = self._scopes.get(block.scope, {}).get(parent.hash)
            if live is not None:
                block.parent = live

    # --- allocation and state changes ---------------------------------------------

    def allocate(self, scope: TenantId, removed: list[Block], now: float) -> SlotId | None:
        """A free slot for a new block of ``scope``, evicting (into ``removed``) if needed.

        None when nothing may be evicted: the pool is full of pinned,
        WRITING or still quarantined slots, or the scope is at its quota with
        nothing of its own to evict. A quarantined slot is never reused
        early to avoid that shortfall: evicting a cached block costs a
        recompute, a late writer's copy would corrupt a block.
        """
        limit = self.quota_of(scope)
        if limit and self._resident.get(scope, 0) >= limit:
            # At quota: only this scope's own blocks may make room. (Quarantined
            # slots count against no scope: their block is gone.)
            if not self._evict_one(removed, self._lru.first_in(scope)):
                return None
        elif not self._slots.available(now) and not self._evict_one(removed, self._lru.first()):
            return None
        slot = self._slots.take(now)
        assert slot is not None, "bug: no free slot after an eviction"
        return slot

    def allocate_run(
        self,
        scope: TenantId,
        chain: Sequence[BlockHash],
        depth: int,
        removed: list[Block],
        now: float,
    ) -> list[SlotId]:
        """Slots for the new blocks of ``chain[depth:]`` (``chain[depth]`` is absent), in one go.

        Without a quota on ``scope``: as many free slots as the rest of the
        chain may need, evicting (into ``removed``) exactly as many blocks as
        `allocate` one block at a time would; fewer when nothing more may be
        evicted, none when not even one slot is to be had. With a quota: one
        slot, by `allocate`. Slots the caller ends up not using go back with
        `untake`.
        """
        if self.quota_of(scope):
            slot = self.allocate(scope, removed, now)
            return [] if slot is None else [slot]
        slots = self._slots
        want = len(chain) - depth
        if slots.available(now) < want:
            # Short of free slots: count what the rest really needs (repeated
            # and present hashes need none) before evicting anything for it.
            present = self._scopes.get(scope, {})
            want = sum(1 for h in dict.fromkeys(chain[depth:]) if h not in present)
            for _ in range(want - slots.free):
                if not self._evict_one(removed, self._lru.first()):
                    break
        return slots.take_many(want)

    def untake(self, slots: list[SlotId]) -> None:
        """Put back slots `allocate_run` gave that no block took (never handed out)."""
        self._slots.untake(slots)

    def ascending_slots(self, blocks: list[Block]) -> bool:
        """Give new WRITING blocks (in chain order) their slots in ascending order.

        Freed slots come back in the order they were freed, and eviction goes
        leaves first, so a chain's slots often return last block first: a
        writer and a reader would then copy one block at a time, backwards,
        where ascending adjacent slots make one copy per run (`Client.store`,
        `Hit.copy_into`), about twice as fast on a host pool. Only for blocks
        whose slots nobody has been told yet (one Reserve's new blocks).
        Every one of those slots was stamped WRITING when its block took it
        (`hand_to_writer`), so a block takes its new slot's generation.
        Returns whether any slot moved.
        """
        slots = [block.slot for block in blocks]
        if all(a < b for a, b in itertools.pairwise(slots)):
            return False
        slots.sort()
        for block, slot in zip(blocks, slots, strict=True):
            assert block.state is BlockState.WRITING, "bug: moving a published block"
            block.slot = slot
            block.generation = self._slots.generation(slot)
        return True

    def add_writing(self, block: Block) -> None:
        """Record a new WRITING block in the slot `allocate` gave it."""
        self._scopes.setdefault(block.scope, {})[block.hash] = block
        self.writing += 1
        self._resident[block.scope] = self._resident.get(block.scope, 0) + 1

    def mark_ready(self, blocks: list[Block], now: float) -> None:
        """WRITING blocks become READY (committed); the caller then `touch`es them.

        Each slot is stamped READY first: a new generation (what Lookup
        answers from now on, never the one it was written under) and the
        block's ident.
        """
        restamp = self._slots.restamp
        for block in blocks:
            assert block.state is BlockState.WRITING, "bug: committing a block not WRITING"
            block.generation = restamp(block.slot, stamp_ident(block.hash))
            block.state = BlockState.READY
            block.writer = None
            block.last_used = now
        self.writing -= len(blocks)

    def drop_writing(self, block: Block, quarantine_until: float | None = None) -> None:
        """Forget an aborted WRITING block; its slot is freed, or quarantined until a time.

        ``quarantine_until`` is given when the writer's lease expired: the
        writer may still be copying into the slot (see `kvstore.slots`).
        """
        assert block.state is BlockState.WRITING
        self.writing -= 1
        self._forget(block, quarantine_until)

    def release_due(self, now: float) -> int:
        """Make quarantined slots whose release time has come free; returns how many."""
        return self._slots.release_due(now)

    def quarantine_snapshot(self) -> list[tuple[float, SlotId]]:
        """(release time, slot) of every quarantined slot, oldest first."""
        return self._slots.quarantine_snapshot()

    def evict(self, n: int) -> list[Block]:
        """Evict up to ``n`` unpinned READY blocks, leaves first; returns them."""
        removed: list[Block] = []
        for _ in range(n):
            if not self._evict_one(removed, self._lru.first()):
                break
        return removed

    def drop_unpinned(self, block: Block) -> bool:
        """Remove one READY block now if nothing pins it (not counted as an eviction)."""
        if block.state is not BlockState.READY or block.refcount:
            return False
        self._remove(block)
        return True

    def clear(self) -> list[Block]:
        """Remove every READY unpinned block (not counted as evictions); returns them."""
        removed = self._lru.evictable()
        for block in removed:
            self._remove(block)
        return removed

    # --- capacity: whole arenas at the end of the pool (`SlotAllocator.add_slots`) ---

    def shortfall(self, scope: TenantId, chain: Iterable[BlockHash]) -> int:
        """Blocks of ``chain`` not resident in ``scope``, beyond the free slots."""
        blocks = self._scopes.get(scope, {})
        return max(0, sum(1 for h in chain if h not in blocks) - self._slots.free)

    def tail_blocks(self, n: int) -> list[Block] | None:
        """The resident blocks in the last ``n`` slots, or None when one is pinned or WRITING.

        None too when one of those slots is quarantined: a late writer may
        still copy into it, so its memory cannot be given back before its
        release time. O(resident blocks): an arena-level operation, never
        per request.
        """
        if self._slots.tail_quarantined(n):
            return None
        first = self.capacity - n
        tail = [b for blocks in self._scopes.values() for b in blocks.values() if b.slot >= first]
        if any(b.state is not BlockState.READY or b.refcount for b in tail):
            return None
        return tail

    def resize(self, delta: int, removed: list[Block], now: float) -> bool:
        """Add ``delta`` free slots, or retire the last ``-delta`` slots.

        Retiring evicts (into ``removed``, counted as evictions) the READY
        blocks those slots hold. It is refused (False, nothing changed) while
        one of them is pinned, WRITING or still quarantined (a late writer may
        touch it), or when it would leave no slot.
        """
        if delta > 0:
            self._slots.add_slots(delta)
        else:
            self._slots.release_due(now)
            tail = self.tail_blocks(-delta) if 0 < -delta < self.capacity else None
            if tail is None:
                return False
            for block in tail:
                self._evict_one(removed, block)
            self._slots.retire_tail(-delta)
        self.capacity += delta
        return True

    def _evict_one(self, removed: list[Block], victim: Block | None) -> bool:
        if victim is None:
            return False
        self._remove(victim)
        self.evictions += 1
        removed.append(victim)
        return True

    def _remove(self, block: Block) -> None:
        """Free a READY unpinned block's slot and forget it."""
        assert block.state is BlockState.READY and block.refcount == 0, "evicting a live block"
        self._lru.remove(block)
        self._forget(block)

    def _forget(self, block: Block, quarantine_until: float | None = None) -> None:
        # An emptied scope dict is dropped: one per tenant name ever seen
        # would grow without bound (auth off: clients invent names). Safe for
        # the callers of `blocks`: none allocates while it holds the dict, and
        # a dropped dict is empty, which is the right answer for them.
        scope_blocks = self._scopes[block.scope]
        del scope_blocks[block.hash]
        if not scope_blocks:
            del self._scopes[block.scope]
        block.state = BlockState.FREE
        block.writer = None
        if quarantine_until is None:
            self._slots.give_back(block.slot)
        else:
            self._slots.quarantine(block.slot, quarantine_until)
        self._resident[block.scope] -= 1
        if not self._resident[block.scope]:
            del self._resident[block.scope]


def _with_ancestors(run: list[Block]) -> list[Block] | None:
    """``run`` preceded by its ancestors, root first, when all of it is one READY chain.

    None when a block of ``run`` is not the parent of the next, or when one
    of them or of their ancestors is not READY (an orphan or a parent link
    to repair: `ScopedLRU.touch` handles those).
    """
    ready = BlockState.READY
    prev: Block | None = None
    for block in run:
        if block.state is not ready or (prev is not None and block.parent is not prev):
            return None
        prev = block
    ancestors: list[Block] = []
    node = run[0].parent if run else None
    while node is not None:
        if node.state is not ready:
            return None
        ancestors.append(node)
        node = node.parent
    ancestors.reverse()
    return ancestors + run
