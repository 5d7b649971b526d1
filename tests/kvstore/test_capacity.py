"""A namespace's pool grows and shrinks by whole arenas: `BlockTable.resize`, `SlotAllocator`."""

from __future__ import annotations

import pytest

from kvstore import EventKind, ReserveStatus, Store, StoreLimits
from kvstore.slots import SlotAllocator
from kvstore.types import LeaseId
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
    # Ids 3 and 4 come back never stamped, like a new arena's stamp memory:
    # generation 0 is no handle's, so a handle from before the retirement stays stale.
    slots.add_slots(2)
    assert slots.generation(4) == 0 != generation and slots.free == 2


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


def test_quarantined_slots_keep_their_arena_until_their_time() -> None:
    # A late writer may still copy into a quarantined slot: its arena must not be
    # unmapped and given to another namespace before the quarantine ends.
    store = Store(StoreLimits(write_quarantine=10.0))
    store.register_namespace(SPEC, capacity=2)
    table = store.table(NS)
    store.open_lease(LeaseId(7), ALICE, 1.0, 0.0)
    result = store.reserve(NS, ALICE, LeaseId(7), chain(prompt(2, 2))[:2], 0.0)
    assert [e.slot for e in result.entries] == [0, 1]
    store.expire(2.0)  # the writer's lease expired: slots 0 and 1 are quarantined
    assert table.stats().quarantined == 2
    assert not table.resize(-1, 5.0)  # refused, and nothing evicted or broken
    assert table.capacity == 2 and table.stats().quarantined == 2
    assert table.resize(-1, 12.5)  # the quarantine is over
    assert table.capacity == 1 and table.stats().free == 1


def test_a_new_chain_gets_ascending_slots_whatever_order_they_were_freed_in() -> None:
    # Eviction goes leaves first, so a chain's slots come back last block
    # first; a reader copies one run of adjacent slots at a time, so the next
    # chain must get them in ascending order, not backwards.
    store = store_of(5)
    runner = Runner(store, 1)
    first = chain(prompt(1, 1))  # 5 blocks: the pool is full
    assert runner.store_chain(first) == 5
    second = chain(prompt(2, 1))
    result = store.reserve(NS, ALICE, runner.lease, second, 2.0)  # evicts all of `first`
    slots = [e.slot for e in result.entries]
    assert [e.status for e in result.entries] == [ReserveStatus.RESERVED] * 5
    assert slots == [0, 1, 2, 3, 4]
    generations = [e.generation for e in result.entries]
    table = store.table(NS)
    assert generations == [table.generation(s) for s in slots]
    assert store.commit(NS, ALICE, runner.lease, second, 3.0) == 5
    hit = store.lookup(NS, ALICE, second, 4.0)
    assert list(hit.slots) == [0, 1, 2, 3, 4]


def test_repeated_hashes_take_and_evict_only_the_slots_they_need() -> None:
    # Reserve takes the slots of a chain's new blocks in one go: repeats (and
    # blocks already present) must neither hold on to extra slots nor evict
    # more than one block per new block.
    store = store_of(5)
    table = store.table(NS)
    runner = Runner(store, 1)
    x, y = chain(prompt(7, 1))[:2]
    result = store.reserve(NS, ALICE, runner.lease, [x, y, x, y], 1.0)
    assert [e.status for e in result.entries] == [ReserveStatus.RESERVED] * 4
    assert table.stats().free == 3  # two new blocks, two slots
    store.abort(NS, ALICE, runner.lease, [x, y], 1.5)
    assert table.stats().free == 5
    assert runner.store_chain(chain(prompt(1, 1))) == 5  # the pool is full
    result = store.reserve(NS, ALICE, runner.lease, [x, y, x, y], 2.0)
    assert [e.status for e in result.entries] == [ReserveStatus.RESERVED] * 4
    stats = table.stats()
    assert stats.evictions == 2 and stats.ready == 3 and stats.writing == 2 and stats.free == 0
