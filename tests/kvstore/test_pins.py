"""Pins without LRU traffic (`kvstore.pins`, `kvstore.eviction`) and array results."""

from __future__ import annotations

import pytest

from kvstore import InvalidArgument, Store
from kvstore.lru import LRUList
from kvstore.results import BlockRef
from tests.kvstore.conftest import ALICE, NS, SPEC, Runner, chain, prompt


def small_store(capacity: int) -> Store:
    store = Store()
    store.register_namespace(SPEC, capacity=capacity)
    return store


def test_a_pin_leaves_the_block_in_place_and_eviction_skips_it() -> None:
    store = small_store(6)
    a = Runner(store, 1)
    old = chain(prompt(1, 1, system_blocks=2, user_blocks=0))
    new = chain(prompt(2, 2, system_blocks=2, user_blocks=0))
    a.store_chain(old, now=1.0)
    a.store_chain(new, now=2.0)
    assert a.hits(old, pin=True, now=3.0) == 2
    stats = store.stats().namespaces[0]
    assert stats.pinned == 2 and stats.evictable == 2
    assert store.table(NS).lru_order() == list(reversed(new))  # pinned ones not offered
    # The pinned chain is at the eviction end, yet the unpinned one goes.
    assert store.evict(NS, 4, 4.0) == 2
    assert a.hits(old, now=5.0) == 2 and a.hits(new, now=5.0) == 0


def test_a_pinned_block_dropped_by_eviction_comes_back_on_release() -> None:
    store = small_store(6)
    a = Runner(store, 1)
    old = chain(prompt(1, 1, system_blocks=2, user_blocks=0))
    new = chain(prompt(2, 2, system_blocks=2, user_blocks=0))
    a.store_chain(old, now=1.0)
    a.store_chain(new, now=2.0)
    a.hits(old, pin=True, now=3.0)
    assert store.evict(NS, 4, 4.0) == 2  # the pinned heads were unlinked on the way
    assert store.table(NS).lru_order() == []
    assert store.release(NS, ALICE, a.lease, old, 5.0) == 2  # a chain: one pass
    assert store.table(NS).lru_order() == list(reversed(old))
    assert store.stats().namespaces[0].evictable == 2
    assert store.evict(NS, 1, 6.0) == 1  # leaves first
    assert a.hits(old, now=7.0) == 1


def test_releasing_part_of_a_chain_touches_its_ancestors() -> None:
    store = small_store(8)
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1, system_blocks=2, user_blocks=1))
    other = chain(prompt(2, 2, system_blocks=2, user_blocks=0))
    a.store_chain(hashes, now=1.0)
    a.store_chain(other, now=2.0)
    a.hits(hashes, pin=True, now=3.0)
    # Not a run from the first block: the general touch walks the ancestors.
    assert store.release(NS, ALICE, a.lease, [hashes[2]], 4.0) == 1
    assert store.table(NS).lru_order() == [*reversed(other), hashes[2]]
    store.release(NS, ALICE, a.lease, hashes[:2], 5.0)
    assert store.table(NS).lru_order() == [*reversed(other), *reversed(hashes)]


def test_a_lookup_result_is_arrays_and_blocks_match_them(store: Store) -> None:
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1))
    a.store_chain(hashes[:3], now=1.0)
    result = store.lookup(NS, ALICE, hashes, 2.0, lease_id=a.lease)
    assert result.hit_blocks == 3 and list(result.hashes) == hashes[:3]
    assert result.slots.typecode == "q" and result.generations.typecode == "Q"
    infos = {i.hash: i for i in store.iter_blocks(NS)}
    assert result.blocks == tuple(
        BlockRef(h, infos[h].slot, infos[h].generation) for h in hashes[:3]
    )
    assert result.blocks is result.blocks  # built once
    empty = store.lookup(NS, ALICE, chain(prompt(9, 9)), 2.0)
    assert empty.hit_blocks == 0 and empty.blocks == () and len(empty.slots) == 0


def test_malformed_hashes_are_refused_wherever_they_sit(store: Store) -> None:
    # Hashes are checked only when one is not found (a found one is well
    # formed): a bad one after the hits, or one that cannot be hashed, still
    # raises InvalidArgument and changes nothing.
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1))
    a.store_chain(hashes, now=1.0)
    for bad in (b"short", "not bytes", bytearray(32), None):
        with pytest.raises(InvalidArgument):
            store.lookup(NS, ALICE, [*hashes, bad], 2.0, lease_id=a.lease)  # type: ignore[list-item]
    assert store.stats().namespaces[0].pinned == 0
    a.hits(hashes, pin=True)
    for bad in (b"short", "not bytes", bytearray(32), None):
        with pytest.raises(InvalidArgument):
            store.release(NS, ALICE, a.lease, [*hashes, bad], 3.0)  # type: ignore[list-item]
    assert store.stats().namespaces[0].pinned == len(hashes)


def test_pin_is_no_lru_work_and_a_chain_release_is_one_pass(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cost structure #14 asked for: a pinned lookup does no LRU operation
    # and the release of the chain it pinned moves the run in one pass, with
    # no per-block unlink/append and no ancestor walk.
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1, system_blocks=8, user_blocks=8))
    a.store_chain(hashes, now=1.0)
    calls: list[str] = []
    for name in ("append", "appendleft", "remove", "move_run_to_end"):
        original = getattr(LRUList, name)

        def spy(self: LRUList, *args: object, _name: str = name, _f: object = original) -> object:
            calls.append(_name)
            return _f(self, *args)  # type: ignore[operator]

        monkeypatch.setattr(LRUList, name, spy)
    assert store.lookup(NS, ALICE, hashes, 2.0, lease_id=a.lease).hit_blocks == 16
    assert calls == []
    assert store.release(NS, ALICE, a.lease, hashes, 3.0) == 16
    assert calls == ["move_run_to_end"]
    assert store.table(NS).lru_order() == list(reversed(hashes))


def test_a_repeated_hash_ends_the_run_and_links_no_block_to_itself(store: Store) -> None:
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1))
    a.store_chain(hashes, now=1.0)
    for bad in ([hashes[0], hashes[0]], [hashes[0], hashes[1], hashes[0], hashes[1]]):
        assert a.hits(bad, pin=True) == len(bad) // 2
    parents = {i.hash: i.parent for i in store.iter_blocks(NS)}
    assert parents == {h: (hashes[i - 1] if i else None) for i, h in enumerate(hashes)}
    # Two pins on block 0, one on block 1: one of each per release.
    assert store.release(NS, ALICE, a.lease, hashes, 3.0) == 2
    assert store.release(NS, ALICE, a.lease, hashes, 3.0) == 1
    assert store.release(NS, ALICE, a.lease, hashes, 3.0) == 0
    assert store.stats().namespaces[0].pinned == 0


def test_a_repeated_hash_in_a_reservation_links_no_block_to_itself(store: Store) -> None:
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1))
    a.store_chain(hashes[:2], now=1.0)
    store.reserve(NS, ALICE, a.lease, [hashes[0], hashes[1], hashes[0], hashes[1]], 2.0)
    parents = {i.hash: i.parent for i in store.iter_blocks(NS)}
    assert parents == {hashes[0]: None, hashes[1]: hashes[0]}
    assert a.hits(hashes, now=3.0) == 2


def test_a_chain_stored_in_pieces_is_relinked_by_the_lookup_through_it(store: Store) -> None:
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1))
    a.store_chain(hashes[2:], now=1.0)  # the tail alone: its first block has no parent
    a.store_chain(hashes[:2], now=1.0)
    assert a.hits(hashes, pin=True, now=2.0) == len(hashes)
    parents = {i.hash: i.parent for i in store.iter_blocks(NS)}
    assert parents == {h: (hashes[i - 1] if i else None) for i, h in enumerate(hashes)}
    assert store.release(NS, ALICE, a.lease, hashes, 3.0) == len(hashes)
    assert store.table(NS).lru_order() == list(reversed(hashes))
