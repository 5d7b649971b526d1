"""The store's random interleavings (test_store_state_machine) with arenas added and retired.

The same rules and invariants, plus a rule that grows the pool by an arena or
retires its last one (`BlockTable.resize`), as the node does under memory
pressure; the counts must add up to the *current* capacity, no block may sit
in a retired slot, and a retirement never takes a pinned or WRITING block.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from kvstore import BlockState
from tests.kvstore.conftest import NS
from tests.kvstore.store_machine import QUARANTINE, TTL, StoreMachine

ARENA = 4
"""Slots per arena (the machine's pool starts with 12: three arenas)."""


class ResizingStoreMachine(StoreMachine):
    @rule(grow=st.booleans())
    def resize(self, grow: bool) -> None:
        table = self.store.table(NS)
        before = {i.hash: i for i in table.iter_blocks()}
        first = table.capacity - ARENA
        busy = any(
            i.slot >= first and (i.state is BlockState.WRITING or i.refcount)
            for i in before.values()
        ) or any(s >= first and t > self.now for t, s in self._quarantine())
        if grow:
            assert table.resize(ARENA, self.now) and table.capacity == first + 2 * ARENA
            return
        expected = not busy and table.capacity > ARENA  # a pool keeps at least one arena
        done = table.resize(-ARENA, self.now)
        assert done == expected
        if done:
            after = {i.hash for i in table.iter_blocks()}
            gone = set(before) - after
            assert gone == {h for h, i in before.items() if i.slot >= first}
        else:
            assert table.capacity == first + ARENA
            assert {i.hash for i in table.iter_blocks()} == set(before)

    @invariant()
    def accounting_adds_up(self) -> None:
        table = self.store.table(NS)
        stats = table.stats()
        assert stats.capacity == table.capacity >= 1
        assert stats.free + stats.quarantined + stats.ready + stats.writing == table.capacity
        assert all(s < table.capacity for _, s in self._quarantine()), "a retired slot quarantined"
        infos = list(self.store.iter_blocks(NS))
        assert len(infos) == stats.ready + stats.writing
        assert len({i.slot for i in infos}) == len(infos), "a slot owned by two blocks"
        assert all(0 <= i.slot < table.capacity for i in infos), "a block in a retired slot"
        evictable = sum(1 for i in infos if i.state is BlockState.READY and i.refcount == 0)
        assert stats.evictable == evictable
        assert stats.pinned == sum(1 for i in infos if i.refcount > 0)

    def teardown(self) -> None:
        self.now += TTL + 1
        self._expire()
        stats = self.store.stats()
        ns = stats.namespaces[0]
        assert ns.pinned == 0 and ns.writing == 0
        assert ns.free + ns.quarantined + ns.ready == ns.capacity
        self.now += QUARANTINE
        self._expire()
        ns = self.store.stats().namespaces[0]
        assert ns.quarantined == 0 and ns.free + ns.ready == ns.capacity


ResizingStoreMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
TestResizingStoreMachine = ResizingStoreMachine.TestCase
