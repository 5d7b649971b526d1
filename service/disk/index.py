"""The disk tier's index: which slot holds which block, and what to evict.

Pure and synchronous (no I/O, no clock): `DiskTier` calls it on the event
loop's thread and hands the offsets it answers to its I/O threads.

Space. The file is cut into regions (64 MiB by default, like the memory
pools' arenas). A region is given to one slot size (a block's length rounded
up to 4 KiB, plus the 4 KiB header page) when that size first needs room,
and taken back when it empties, so namespaces of any block sizes share the
one preallocated file and its cap. A reservation takes, in order:

1. a free slot in a region of its size;
2. a free region;
3. the least recently used block of its size, or, when another size's least
   recently used region was touched longer ago than that block, that whole
   region (its blocks are evicted; a new region epoch makes their headers
   stale with one page written).

So eviction is LRU over blocks within a size and LRU over regions across
sizes. Blocks with a read or write in flight are never evicted.

Life of a slot: free → WRITING (reserved; not visible to lookups) → READY
(write completed) → evicted (reused at once: its header is invalidated
before the new write) or removed (drop, failed read, failed write): it then
waits in *limbo* until the tier has zeroed its header page, so a restart
can never bring the block back, and only then becomes free again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from service.disk.entry import LRU, Entry, EntryState, Key
from service.disk.format import (
    RegionHeader,
    region_offset,
    slot_bytes_for,
    slot_offset,
    slots_per_region,
)

Found = tuple[int, int, Key, int, int]
"""A valid slot header found at open: (seq, slot, key, length, checksum)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The index as a checkpoint keeps it (`DiskIndex.snapshot`, `restore`)."""

    regions: list[tuple[int, int, int]]
    """(region, slot_bytes, epoch) of every region given to a slot size."""
    entries: list[tuple[int, int, int, Key, int, int]]
    """(region, slot, seq, key, length, checksum), least recently used first."""
    limbo: list[tuple[int, int]]
    """(region, slot) whose header page is still to be zeroed."""
    next_seq: int
    next_epoch: int
    scopes: dict[int, bytes] = field(default_factory=dict)
    """Tenant scope names by u64 digest (`DiskKey.scope_name`): the checkpoint keeps them."""


@dataclass(slots=True)
class Region:
    index: int
    slot_bytes: int = 0
    """0 while the region is free."""
    epoch: int = 0
    slots: int = 0
    next_unused: int = 0
    free: list[int] = field(default_factory=list)
    entries: dict[int, Entry] = field(default_factory=dict)
    """Slot → its entry (WRITING or READY)."""
    limbo: set[int] = field(default_factory=set)
    busy: int = 0
    """I/O in flight on its slots (writes, reads): the region cannot be taken."""
    last_touch: int = 0

    def has_room(self) -> bool:
        return bool(self.free) or self.next_unused < self.slots


@dataclass(frozen=True, slots=True)
class Reservation:
    """A slot handed to a writer: where to write, and what to write first."""

    entry: Entry
    offset: int
    slot_bytes: int
    epoch: int
    seq: int
    invalidate: bool
    """The slot held another block: zero its header page before writing."""
    region_header: tuple[int, RegionHeader] | None
    """(offset, header) to write before the slot: the region was just given to this size."""


@dataclass(slots=True)
class _SizeClass:
    regions: set[int] = field(default_factory=set)
    with_room: set[int] = field(default_factory=set)
    lru: LRU = field(default_factory=LRU)


class DiskIndex:
    """Slots, entries and LRUs of one tier file. Side effects leave as data:
    `take_removed` (blocks that left), `take_invalidations` (header pages the
    tier must zero)."""

    def __init__(self, regions: int, region_bytes: int) -> None:
        self.region_bytes = region_bytes
        self._regions = [Region(i) for i in range(regions)]
        self._free_regions = list(range(regions - 1, -1, -1))  # pop() takes region 0 first
        self._classes: dict[int, _SizeClass] = {}
        self._entries: dict[Key, Entry] = {}
        self._per_namespace: dict[bytes, int] = {}
        self._removed: list[Key] = []
        self._invalidations: list[tuple[int, int, int]] = []
        self.next_seq = 1
        self.next_epoch = 1
        self._clock = 0
        self.ready_blocks = 0
        self.used_bytes = 0
        self.evictions = 0

    # -- queries -------------------------------------------------------------

    def __contains__(self, key: Key) -> bool:
        """Known in any state (being written included)."""
        return key in self._entries

    def ready(self, key: Key) -> Entry | None:
        e = self._entries.get(key)
        return e if e is not None and e.state is EntryState.READY else None

    def run_length(self, namespace: bytes, scope: int, hashes: Sequence[bytes]) -> int:
        entries = self._entries
        n = 0
        for h in hashes:
            e = entries.get((namespace, scope, h))
            if e is None or e.state is not EntryState.READY:
                break
            n += 1
        return n

    def per_namespace(self) -> dict[bytes, int]:
        return dict(self._per_namespace)

    def ready_keys(self, namespace: bytes) -> list[Key]:
        """The keys of a namespace's READY blocks (a directory resync lists them)."""
        entries = self._entries.items()
        return [k for k, e in entries if k[0] == namespace and e.state is EntryState.READY]

    def offset_of(self, e: Entry) -> int:
        region = self._regions[e.region]
        return slot_offset(e.region, e.slot, self.region_bytes, region.slot_bytes)

    def region(self, index: int) -> Region:
        return self._regions[index]

    # -- writes --------------------------------------------------------------

    def reserve(self, key: Key, length: int, checksum: int) -> Reservation | None:
        """A slot for a new block, evicting if need be; None when nothing can be had.

        The key must not be known (`__contains__`).
        """
        assert key not in self._entries, "reserve of a block already known"
        size = slot_bytes_for(length)
        if slots_per_region(self.region_bytes, size) < 1:
            return None
        cls = self._classes.setdefault(size, _SizeClass())
        region_header = None
        invalidate = False
        slot = -1
        if cls.with_room:
            r = self._regions[next(iter(cls.with_room))]
        elif self._free_regions:
            r = self._regions[self._free_regions.pop()]
            region_header = self._assign(r, size, cls)
        else:
            victim = self._lru_victim(cls)
            stolen = self._region_victim(size)
            if stolen is not None and (victim is None or stolen.last_touch < victim.touch):
                region_header = self._steal(stolen, size, cls)
                r = stolen
            elif victim is not None:
                r = self._regions[victim.region]
                slot = victim.slot
                self._evict(victim)
                invalidate = True
            else:
                return None
        if slot < 0:
            slot = r.free.pop() if r.free else r.next_unused
            if slot == r.next_unused:
                r.next_unused += 1
            if not r.has_room():
                cls.with_room.discard(r.index)
        seq = self.next_seq
        self.next_seq += 1
        e = Entry(key, r.index, slot, length, checksum, seq, EntryState.WRITING)
        r.entries[slot] = e
        r.busy += 1
        self._entries[key] = e
        header = None
        if region_header is not None:
            header = (region_offset(r.index, self.region_bytes), region_header)
        offset = slot_offset(r.index, slot, self.region_bytes, size)
        return Reservation(e, offset, size, r.epoch, seq, invalidate, header)

    def committed(self, e: Entry) -> bool:
        """The write of ``e`` completed: the block becomes readable (most recently
        used). False when it was forgotten meanwhile (its slot went to limbo)."""
        assert e.state is EntryState.WRITING, "committed twice"
        r = self._regions[e.region]
        r.busy -= 1
        if e.dropped:
            self._to_limbo(e)
            return False
        e.state = EntryState.READY
        self._link(e, r)
        self._count(e, +1)
        return True

    def write_failed(self, e: Entry) -> None:
        """The write of ``e`` failed: no entry is left; its header page is zeroed behind."""
        assert e.state is EntryState.WRITING, "write_failed of a completed write"
        self._regions[e.region].busy -= 1
        if not e.dropped:
            del self._entries[e.key]
        self._to_limbo(e)

    # -- reads ---------------------------------------------------------------

    def begin_read(self, key: Key) -> Entry | None:
        """Pin a READY block for a read (it cannot be evicted meanwhile)."""
        e = self.ready(key)
        if e is None:
            return None
        e.readers += 1
        self._regions[e.region].busy += 1
        return e

    def end_read(self, e: Entry, *, touch: bool, discard: bool) -> None:
        """The read ended: touch the block (most recently used), discard it, or neither."""
        e.readers -= 1
        r = self._regions[e.region]
        r.busy -= 1
        if e.dropped:
            if e.readers == 0:
                self._to_limbo(e)
        elif discard:
            self._forget(e)
        elif touch:
            self._classes[r.slot_bytes].lru.remove(e)
            self._link(e, r)

    # -- removal -------------------------------------------------------------

    def drop_namespace(self, namespace: bytes) -> int:
        doomed = [e for k, e in self._entries.items() if k[0] == namespace]
        for e in doomed:
            self._forget(e)
        return len(doomed)

    def invalidated(self, region: int, slot: int) -> None:
        """The header page of a slot in limbo has been zeroed: the slot is free."""
        r = self._regions[region]
        r.limbo.remove(slot)
        r.busy -= 1
        r.free.append(slot)
        self._classes[r.slot_bytes].with_room.add(region)
        self._maybe_release(r)

    def take_removed(self) -> list[Key]:
        out, self._removed = self._removed, []
        return out

    def take_invalidations(self) -> list[tuple[int, int, int]]:
        """(offset, region, slot) of header pages to zero, then report `invalidated`."""
        out, self._invalidations = self._invalidations, []
        return out

    # -- rebuild -------------------------------------------------------------

    def adopt_region(self, index: int, header: RegionHeader, found: Sequence[Found]) -> None:
        """At open: a region found on disk, given to ``header.slot_bytes``, and
        the valid slot headers in it. Call `adopted` after the last region.

        A block found twice keeps its newest write (the older slot is zeroed behind).
        """
        r = self._regions[index]
        self._free_regions.remove(index)
        cls = self._classes.setdefault(header.slot_bytes, _SizeClass())
        r.slot_bytes, r.epoch = header.slot_bytes, header.epoch
        r.slots = slots_per_region(self.region_bytes, header.slot_bytes)
        cls.regions.add(index)
        self.next_epoch = max(self.next_epoch, header.epoch + 1)
        entries = self._entries
        next_seq = self.next_seq
        for seq, slot, key, length, checksum in found:
            e = Entry(key, index, slot, length, checksum, seq, EntryState.READY)
            r.entries[slot] = e
            old = entries.get(key)
            if old is not None:
                if old.seq > seq:
                    self._to_limbo(e)
                    continue
                self._to_limbo(old)
            entries[key] = e
            if seq >= next_seq:
                next_seq = seq + 1
        self.next_seq = next_seq

    def adopted(self) -> None:
        """At open, after the last `adopt_region`: the LRU in write order, the
        counts, the free slots; regions that hold nothing are handed back."""
        for e in sorted(self._entries.values(), key=attrgetter("seq")):
            self._link(e, self._regions[e.region])
            self._count(e, +1)
        self._settle()

    def snapshot(self) -> Snapshot:
        """What a checkpoint keeps: regions, READY blocks least recently used
        first, slots whose header may still name a block (limbo, writes cut short)."""
        regions = [(r.index, r.slot_bytes, r.epoch) for r in self._regions if r.slot_bytes]
        ready = [e for e in self._entries.values() if e.state is EntryState.READY]
        ready.sort(key=attrgetter("touch"))
        entries = [(e.region, e.slot, e.seq, e.key, e.length, e.checksum) for e in ready]
        limbo = [(r.index, s) for r in self._regions for s in r.limbo]
        limbo += [
            (r.index, s)
            for r in self._regions
            for s, e in r.entries.items()
            if e.dropped or e.state is EntryState.WRITING
        ]
        return Snapshot(regions, entries, limbo, self.next_seq, self.next_epoch)

    def restore(self, snap: Snapshot) -> None:
        """At open, from a checkpoint: the index as `snapshot` saw it (limbo slots
        are handed out again to be zeroed, `take_invalidations`)."""
        for index, slot_bytes, epoch in snap.regions:
            self._free_regions.remove(index)
            r = self._regions[index]
            r.slot_bytes, r.epoch = slot_bytes, epoch
            r.slots = slots_per_region(self.region_bytes, slot_bytes)
            self._classes.setdefault(slot_bytes, _SizeClass()).regions.add(index)
        for region, slot, seq, key, length, checksum in snap.entries:
            r = self._regions[region]
            e = Entry(key, region, slot, length, checksum, seq, EntryState.READY)
            r.entries[slot] = e
            self._entries[key] = e
            self._link(e, r)
            self._count(e, +1)
        for region, slot in snap.limbo:
            r = self._regions[region]
            r.limbo.add(slot)
            r.busy += 1
            self._invalidations.append(
                (slot_offset(region, slot, self.region_bytes, r.slot_bytes), region, slot)
            )
        self.next_seq, self.next_epoch = snap.next_seq, snap.next_epoch
        self._settle()

    def _settle(self) -> None:
        for r in self._regions:
            if not r.slot_bytes:
                continue
            used = set(r.entries) | r.limbo
            r.next_unused = max(used) + 1 if used else 0
            r.free = [s for s in range(r.next_unused - 1, -1, -1) if s not in used]
            if r.has_room():
                self._classes[r.slot_bytes].with_room.add(r.index)
            self._maybe_release(r)

    # -- internals -----------------------------------------------------------

    def _assign(self, r: Region, size: int, cls: _SizeClass) -> RegionHeader:
        assert not r.entries and not r.limbo and r.busy == 0
        r.slot_bytes, r.epoch = size, self.next_epoch
        self.next_epoch += 1
        r.slots = slots_per_region(self.region_bytes, size)
        r.next_unused, r.free = 0, []
        cls.regions.add(r.index)
        cls.with_room.add(r.index)
        return RegionHeader(size, r.epoch, r.index)

    def _steal(self, r: Region, size: int, cls: _SizeClass) -> RegionHeader:
        for e in list(r.entries.values()):
            assert e.state is EntryState.READY and e.readers == 0
            self._evict(e)
        old = self._classes[r.slot_bytes]
        old.regions.discard(r.index)
        old.with_room.discard(r.index)
        r.entries.clear()
        return self._assign(r, size, cls)

    def _lru_victim(self, cls: _SizeClass) -> Entry | None:
        for e in cls.lru:
            if e.readers == 0:
                return e
        return None

    def _region_victim(self, size: int) -> Region | None:
        best: Region | None = None
        for s, cls in self._classes.items():
            if s == size:
                continue
            for i in cls.regions:
                r = self._regions[i]
                if r.busy == 0 and not r.limbo and (best is None or r.last_touch < best.last_touch):
                    best = r
        return best

    def _link(self, e: Entry, r: Region) -> None:
        """Make an unlinked READY entry the most recently used of its size."""
        self._clock += 1
        e.touch = r.last_touch = self._clock
        self._classes[r.slot_bytes].lru.append(e)

    def _count(self, e: Entry, sign: int) -> None:
        ns = e.key[0]
        n = self._per_namespace.get(ns, 0) + sign
        if n:
            self._per_namespace[ns] = n
        else:
            self._per_namespace.pop(ns, None)
        self.ready_blocks += sign
        self.used_bytes += sign * self._regions[e.region].slot_bytes

    def _evict(self, e: Entry) -> None:
        """Take a READY block out for its slot to be reused at once (no limbo)."""
        r = self._regions[e.region]
        self._classes[r.slot_bytes].lru.remove(e)
        self._count(e, -1)
        del self._entries[e.key]
        del r.entries[e.slot]
        self._removed.append(e.key)
        self.evictions += 1

    def _forget(self, e: Entry) -> None:
        """Remove a block (drop, discard): to limbo now, or once its I/O ends."""
        del self._entries[e.key]
        if e.state is EntryState.READY:
            self._classes[self._regions[e.region].slot_bytes].lru.remove(e)
            self._count(e, -1)
            self._removed.append(e.key)
        if e.readers or e.state is EntryState.WRITING:
            e.dropped = True
        else:
            self._to_limbo(e)

    def _to_limbo(self, e: Entry) -> None:
        r = self._regions[e.region]
        del r.entries[e.slot]
        r.limbo.add(e.slot)
        r.busy += 1  # the invalidation write
        self._invalidations.append((self.offset_of(e), e.region, e.slot))

    def _maybe_release(self, r: Region) -> None:
        """Hand an empty region back: every slot header in it is zero or stale."""
        if r.slot_bytes and not r.entries and not r.limbo and r.busy == 0:
            cls = self._classes[r.slot_bytes]
            cls.regions.discard(r.index)
            cls.with_room.discard(r.index)
            r.slot_bytes = 0
            self._free_regions.append(r.index)
