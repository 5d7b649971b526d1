"""The disk index under random interleavings of everything the tier does to it.

Invariants checked after every step: no slot holds two blocks, a slot is
free, in use or in limbo and never two of these, every block lies in a
region of its slot size, the counts add up, and nothing is ever placed past
the file's regions (the cap).
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from service.disk.entry import Entry, EntryState
from service.disk.format import PAGE, slot_bytes_for, slot_offset
from service.disk.index import DiskIndex, Reservation

REGION = 32 * PAGE
REGIONS = 4
LENGTHS = [PAGE, 2 * PAGE, 3 * PAGE + 1, 7 * PAGE]
NAMESPACES = [b"a" * 16, b"b" * 16]


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = DiskIndex(REGIONS, REGION)
        self.writing: list[Reservation] = []
        self.reading: list[Entry] = []
        self.pending: list[tuple[int, int, int]] = []
        self.next_hash = 0

    @rule(ns=st.sampled_from(NAMESPACES), length=st.sampled_from(LENGTHS))
    def reserve(self, ns: bytes, length: int) -> None:
        self.next_hash += 1
        res = self.index.reserve((ns, 0, self.next_hash), length, 1)
        if res is not None:
            assert res.slot_bytes == slot_bytes_for(length)
            assert res.offset + res.slot_bytes <= REGIONS * REGION + (1 << 20), "past the cap"
            self.writing.append(res)
        self.pending += self.index.take_invalidations()

    @precondition(lambda self: self.writing)
    @rule(i=st.integers(0, 1000), ok=st.booleans())
    def write_ends(self, i: int, ok: bool) -> None:
        res = self.writing.pop(i % len(self.writing))
        if ok:
            self.index.committed(res.entry)
        else:
            self.index.write_failed(res.entry)
        self.pending += self.index.take_invalidations()

    @rule(h=st.integers(1, 200), ns=st.sampled_from(NAMESPACES))
    def read_begins(self, h: int, ns: bytes) -> None:
        e = self.index.begin_read((ns, 0, h))
        if e is not None:
            self.reading.append(e)

    @precondition(lambda self: self.reading)
    @rule(i=st.integers(0, 1000), outcome=st.sampled_from(["ok", "bad", "cancelled"]))
    def read_ends(self, i: int, outcome: str) -> None:
        e = self.reading.pop(i % len(self.reading))
        self.index.end_read(e, touch=outcome == "ok", discard=outcome == "bad")
        self.pending += self.index.take_invalidations()

    @rule(ns=st.sampled_from(NAMESPACES))
    def drop(self, ns: bytes) -> None:
        self.index.drop_namespace(ns)
        self.pending += self.index.take_invalidations()

    @precondition(lambda self: self.pending)
    @rule()
    def invalidations_land(self) -> None:
        for _, region, slot in self.pending:
            self.index.invalidated(region, slot)
        self.pending.clear()

    @invariant()
    def slots_are_consistent(self) -> None:
        index = self.index
        ready = 0
        used_bytes = 0
        for i in range(REGIONS):
            r = index.region(i)
            if not r.slot_bytes:
                assert not r.entries and not r.limbo
                continue
            in_use = set(r.entries)
            free = set(r.free)
            assert len(free) == len(r.free), "a slot free twice"
            assert not (in_use & free) and not (in_use & r.limbo) and not (free & r.limbo)
            assert all(s < r.next_unused <= r.slots for s in in_use | free | r.limbo)
            for slot, e in r.entries.items():
                assert e.slot == slot and e.region == i
                assert slot_bytes_for(e.length) == r.slot_bytes, (
                    "a block in a region of another size"
                )
                assert index.offset_of(e) == slot_offset(i, slot, REGION, r.slot_bytes)
                if e.state is EntryState.READY and not e.dropped:
                    ready += 1
                    used_bytes += r.slot_bytes
        assert ready == index.ready_blocks == sum(index.per_namespace().values())
        assert used_bytes == index.used_bytes


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
