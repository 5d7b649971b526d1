"""A namespace's pool grows and shrinks by whole arenas: `BlockTable.resize`, `SlotAllocator`."""

from __future__ import annotations

import pytest

from kvstore import EventKind, ReserveStatus, Store, StoreLimits
from kvstore.slots import SlotAllocator
from tests.kvstore.conftest import ALICE, NS, SPEC, Runner, chain, prompt


def store_of(capacity: int) -> Store:
    store = Store(StoreLimits())
    store.register_namespace(SPEC, capacity=capacity)
    return store


def test_slots_grow_at_the_end_and_retire_only_a_free_tail() -> None:
    slots = SlotAllocator(2)
    assert [slots.take(0.0), slots.take(0.0), slots.take(0.0)] == [0, 1, None]
    slots.add_slots(3)
    assert slots.capacity == 5 and slots.free == 3
    assert sorted(s for s in iter(lambda: slots.take(0.0), None)) == [2, 3, 4]
    slots.give_back(4)
    slots.give_back(3)
    assert slots.tail_is_free(2) and not slots.tail_is_free(3)
    generation = slots.generation(4)
    slots.retire_tail(2)
    assert slots.capacity == 3 and slots.free == 0
    with pytest.raises(RuntimeError):
        slots.retire_tail(1)  # slot 2 is in use
    slots.add_slots(2)  # ids 3 and 4 come back with the generations they had
    assert slots.generation(4) == generation and slots.free == 2


def test_new_slots_are_used_after_the_older_free_ones() -> None:
    slots = SlotAllocator(2)
    assert slots.take(0.0) == 0
    slots.add_slots(2)
    assert [slots.take(0.0), slots.take(0.0), slots.take(0.0)] == [1, 2, 3]  # the tail fills last


def test_grow_makes_room_without_eviction() -> None:
    store = store_of(3)
    table = store.table(NS)
    runner = Runner(store, 1)
    hashes = chain(prompt(1, 1))  # 5 blocks
    assert table.shortfall(ALICE, hashes) == 2
    assert table.resize(4, 1.0)
    assert table.capacity == 7 and table.shortfall(ALICE, hashes) == 0
    assert runner.store_chain(hashes) == 5
    stats = table.stats()
    assert stats.capacity == 7 and stats.free == 2 and stats.ready == 5 and stats.evictions == 0
    assert table.shortfall(ALICE, hashes) == 0  # resident blocks need no slot


def test_retire_evicts_ready_blocks_of_the_tail_and_refuses_pinned_ones() -> None:
    store = store_of(4)
    table = store.table(NS)
    runner = Runner(store, 1)
    hashes = chain(prompt(1, 1, system_blocks=2, user_blocks=2))  # 4 blocks: slots 0..3
    runner.store_chain(hashes)
    store.take_events()
    slot_of = {b.hash: b.slot for b in table.iter_blocks()}
    tail = {h for h, s in slot_of.items() if s >= 2}
    runner.hits(hashes, pin=True)
    assert not table.resize(-2, 3.0)  # pinned: nothing changes
    assert table.capacity == 4 and len(table) == 4
    store.release(NS, ALICE, runner.lease, hashes, 3.0)
    assert table.resize(-2, 4.0)
    stats = table.stats()
    assert stats.capacity == 2 and stats.free + stats.ready + stats.writing == 2
    assert {b.hash for b in table.iter_blocks()} == set(hashes) - tail
    (event,) = store.take_events()
    assert event.kind is EventKind.REMOVED and set(event.hashes) == tail
    assert not table.resize(-2, 5.0)  # a pool keeps at least one slot


def test_writing_blocks_keep_their_arena() -> None:
    store = store_of(2)
    table = store.table(NS)
    runner = Runner(store, 1)
    result = store.reserve(NS, ALICE, runner.lease, chain(prompt(2, 2))[:2], 1.0)
    assert [e.status for e in result.entries] == [ReserveStatus.RESERVED] * 2
    table.resize(2, 1.0)
    assert table.resize(-2, 1.0)  # the new arena is empty
    assert not table.resize(-1, 1.0)  # slot 1 is WRITING


def test_a_quarantined_tail_slot_is_not_retired_before_its_release_time() -> None:
    # An expired writer may still copy into its slot: giving the arena back
    # before the quarantine ends must be refused, not crash the allocator.
    store = Store(StoreLimits(write_quarantine=5.0))
    store.register_namespace(SPEC, capacity=2)
    table = store.table(NS)
    runner = Runner(store, 1)
    hashes = chain(prompt(2, 2))[:2]
    store.reserve(NS, ALICE, runner.lease, hashes, 1.0)
    store.expire(1e6)  # both slots quarantined until 1e6 + 5
    assert table.stats().quarantined == 2
    assert not table.resize(-1, 1e6 + 1)
    assert table.capacity == 2
    store.expire(1e6 + 5)
    assert table.resize(-1, 1e6 + 5)
    assert table.capacity == 1
