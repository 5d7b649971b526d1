"""Slot stamps in the core: unique generations, and a stamp that moves before a slot does."""

from __future__ import annotations

from kvstore import Store
from kvstore.results import BlockRef
from kvstore.stamps import GenerationCounter, MemoryStamps, stamp_ident
from kvstore.types import SlotId

from .conftest import ALICE, NS, SPEC, Runner, chain, prompt


def _store_with(stamps: MemoryStamps, capacity: int = 64) -> Store:
    store = Store()
    store.register_namespace(SPEC, capacity=capacity, stamps=stamps)
    return store


def test_generations_never_repeat_across_drop_and_register_again() -> None:
    store = Store()
    store.register_namespace(SPEC, capacity=8)
    hashes = chain(prompt(1, 1))
    Runner(store, 1).store_chain(hashes)
    first = store.lookup(NS, ALICE, hashes, 2.0)
    store.drop_namespace(NS, 3.0, force=True)
    store.register_namespace(SPEC, capacity=8)
    Runner(store, 2).store_chain(hashes, now=4.0)
    second = store.lookup(NS, ALICE, hashes, 5.0)
    # The same chain in the same slots of a namespace with the same id...
    assert list(second.slots) == list(first.slots)
    # ...never shows a generation it showed before, nor 0 (never stamped).
    assert not set(first.generations) & set(second.generations)
    assert 0 not in set(first.generations) | set(second.generations)


def test_stamp_moves_when_handed_to_a_writer_committed_freed_and_reused() -> None:
    stamps = MemoryStamps()
    store = _store_with(stamps, capacity=5)
    writer = Runner(store, 1)
    hashes = chain(prompt(1, 1))  # 5 blocks: the pool is full
    reserved = store.reserve(NS, ALICE, writer.lease, hashes, 1.0)
    slot = SlotId(reserved.entries[0].slot)
    writing = stamps.get(slot)
    # Handed to a writer: a new generation, no ident (a WRITING slot is nobody's block).
    assert writing == (reserved.entries[0].generation, 0) and writing[0] > 0
    store.commit(NS, ALICE, writer.lease, hashes, 2.0)
    ready = stamps.get(slot)
    # Committed: another generation (what Lookup answers) and the block's ident.
    assert ready[0] > writing[0] and ready[1] == stamp_ident(hashes[0]) != 0
    assert store.lookup(NS, ALICE, hashes, 3.0).generations[0] == ready[0]
    assert store.table(NS).stamp_of(slot) == ready
    # Another chain evicts it: freed (moved on, no ident), then handed to the
    # new writer (moved on again) before that writer hears of the slot.
    other = chain(prompt(2, 2))
    again = store.reserve(NS, ALICE, Runner(store, 2).lease, other, 4.0)
    assert slot in [e.slot for e in again.reserved]
    entry = next(e for e in again.reserved if e.slot == slot)
    assert stamps.get(slot) == (entry.generation, 0)
    assert entry.generation > ready[0] + 1  # the free stamp came in between


def test_every_stamp_change_is_a_new_generation() -> None:
    seen: list[int] = []

    class Log(MemoryStamps):
        def stamp(self, slot: SlotId, generation: int, ident: int) -> None:
            seen.append(generation)
            super().stamp(slot, generation, ident)

    store = _store_with(Log(), capacity=5)
    a, b = Runner(store, 1), Runner(store, 2)
    a.store_chain(chain(prompt(1, 1)))
    b.store_chain(chain(prompt(2, 2)), now=2.0)  # evicts a's blocks
    store.reserve(NS, ALICE, a.lease, chain(prompt(3, 3)), 3.0)
    store.abort(NS, ALICE, a.lease, chain(prompt(3, 3)), 4.0)
    assert len(seen) == len(set(seen)) and seen == sorted(seen)


def test_abort_and_expiry_move_the_stamp() -> None:
    stamps = MemoryStamps()
    store = _store_with(stamps, capacity=8)
    runner = Runner(store, 1)
    hashes = chain(prompt(1, 1))
    entries = store.reserve(NS, ALICE, runner.lease, hashes, 1.0).entries
    store.abort(NS, ALICE, runner.lease, hashes[:2], 2.0)
    for e in entries[:2]:
        assert stamps.get(SlotId(e.slot))[0] > e.generation
    store.expire(100.0)  # the lease is gone: its other writes are quarantined
    for e in entries[2:]:
        generation, ident = stamps.get(SlotId(e.slot))
        assert generation > e.generation and ident == 0


def test_ascending_slots_keep_each_blocks_stamp() -> None:
    stamps = MemoryStamps()
    store = _store_with(stamps, capacity=5)
    Runner(store, 1).store_chain(chain(prompt(1, 1)))
    # Evicting the first chain frees its slots leaves first: backwards. The
    # new chain's blocks are moved to ascending slots after they were stamped.
    result = store.reserve(NS, ALICE, Runner(store, 2).lease, chain(prompt(2, 1)), 2.0)
    assert [e.slot for e in result.entries] == [0, 1, 2, 3, 4]
    for e in result.entries:
        assert stamps.get(SlotId(e.slot)) == (e.generation, 0)


def test_stamp_intact_takes_only_the_ready_stamp_it_was_given() -> None:
    store = Store()
    store.register_namespace(SPEC, capacity=8)
    hashes = chain(prompt(1, 1))
    Runner(store, 1).store_chain(hashes)
    ref = store.lookup(NS, ALICE, hashes, 2.0).blocks[0]
    assert store.stamp_intact(NS, ref)
    store.drop_namespace(NS, 3.0, force=True)
    assert not store.stamp_intact(NS, ref)
    store.register_namespace(SPEC, capacity=8)
    store.reserve(NS, ALICE, Runner(store, 2).lease, hashes, 4.0)  # same slot, WRITING
    assert store.table(NS).stamp_of(ref.slot)[1] == 0
    assert not store.stamp_intact(NS, ref)
    assert not store.stamp_intact(NS, BlockRef(ref.hash, ref.slot, 0))


def test_a_shared_counter_serves_every_table() -> None:
    counter = GenerationCounter()
    assert [counter.next(), counter.next()] == [1, 2] and counter.last == 2
