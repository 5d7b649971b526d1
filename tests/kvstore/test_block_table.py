"""Block life cycle, pins, eviction order, events and stats of the core store."""

from __future__ import annotations

import pytest

from kvstore import (
    BlockRef,
    EventKind,
    InvalidArgument,
    KVLayout,
    LayoutConflict,
    LimitExceeded,
    MissReason,
    NamespaceSpec,
    NotWriter,
    ReserveStatus,
    StaleSlot,
    Store,
    StoreLimits,
    UnknownNamespace,
)
from kvstore.types import BlockHash, NamespaceId
from tests.kvstore.conftest import ALICE, NS, SPEC, Runner, chain, prompt


def small_store(capacity: int, **limits: int) -> Store:
    store = Store(StoreLimits(**limits))  # type: ignore[arg-type]
    store.register_namespace(SPEC, capacity=capacity)
    return store


def test_writing_blocks_are_invisible_and_in_flight_for_others(store: Store) -> None:
    a, b = Runner(store, 1), Runner(store, 2)
    hashes = chain(prompt(1, 1))
    store.reserve(NS, ALICE, a.lease, hashes, 1.0)
    result = store.lookup(NS, ALICE, hashes, 1.0)
    assert result.hit_blocks == 0
    assert result.miss_reason is MissReason.IN_FLIGHT
    statuses = {e.status for e in store.reserve(NS, ALICE, b.lease, hashes, 1.0).entries}
    assert statuses == {ReserveStatus.IN_FLIGHT}


def test_reserve_is_idempotent_for_the_same_lease(store: Store) -> None:
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1))
    first = store.reserve(NS, ALICE, a.lease, hashes, 1.0)
    again = store.reserve(NS, ALICE, a.lease, hashes, 1.0)
    assert [e.slot for e in first.entries] == [e.slot for e in again.entries]
    assert store.stats().namespaces[0].writing == 5


def test_no_room_is_a_partial_result_not_an_exception() -> None:
    store = small_store(3)
    a = Runner(store, 1)
    result = store.reserve(NS, ALICE, a.lease, chain(prompt(1, 1)), 1.0)
    assert [e.status for e in result.entries] == [ReserveStatus.RESERVED] * 3 + [
        ReserveStatus.NO_ROOM
    ] * 2
    assert not result.complete


def test_capacity_is_never_exceeded_and_pinned_blocks_never_evicted() -> None:
    store = small_store(5)
    a = Runner(store, 1)
    first = chain(prompt(1, 1))
    a.store_chain(first)
    assert a.hits(first, pin=True) == 5
    result = store.reserve(NS, ALICE, a.lease, chain(prompt(2, 1)), 3.0)
    assert {e.status for e in result.entries} == {ReserveStatus.NO_ROOM}
    assert a.hits(first) == 5
    store.release(NS, ALICE, a.lease, first, 4.0)
    assert a.store_chain(chain(prompt(2, 1)), now=5.0) == 5


def test_reserving_a_tail_never_evicts_its_own_prefix() -> None:
    store = small_store(5)
    a = Runner(store, 1)
    base = prompt(1, 1, system_blocks=3, user_blocks=0)
    a.store_chain(chain(base), now=1.0)
    other = chain(prompt(9, 9, system_blocks=2, user_blocks=0))
    a.store_chain(other, now=2.0)  # full now; base's blocks are the LRU victims
    longer = chain(base + list(range(900, 908)))  # base + 2 new blocks
    result = store.reserve(NS, ALICE, a.lease, longer, 3.0)
    assert [e.status for e in result.entries[:3]] == [ReserveStatus.HIT] * 3
    assert [e.status for e in result.entries[3:]] == [ReserveStatus.RESERVED] * 2
    assert a.hits(other, now=4.0) == 0  # the other chain made room


def test_commit_is_validated_whole_before_anything_changes(store: Store) -> None:
    a, b = Runner(store, 1), Runner(store, 2)
    mine = chain(prompt(1, 1))
    theirs = chain(prompt(2, 1))
    store.reserve(NS, ALICE, a.lease, mine, 1.0)
    store.reserve(NS, ALICE, b.lease, theirs, 1.0)
    with pytest.raises(NotWriter):
        store.commit(NS, ALICE, a.lease, [*mine, theirs[0]], 2.0)
    assert store.stats().namespaces[0].ready == 0
    assert store.commit(NS, ALICE, a.lease, mine, 2.0) == 5
    # A retried commit of READY blocks is accepted and changes nothing.
    assert store.commit(NS, ALICE, a.lease, mine, 2.0) == 0


def test_abort_frees_slots_and_bumps_generations(store: Store) -> None:
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1))
    entries = store.reserve(NS, ALICE, a.lease, hashes, 1.0).entries
    assert store.abort(NS, ALICE, a.lease, hashes, 2.0) == 5
    assert store.abort(NS, ALICE, a.lease, hashes, 2.0) == 0
    stats = store.stats().namespaces[0]
    assert stats.free == stats.capacity
    table = store.table(NS)
    for e in entries:
        assert e.slot is not None
        assert table.generation(e.slot) > e.generation  # moved on: never repeats
        with pytest.raises(StaleSlot):
            store.check_slot(NS, ALICE, BlockRef(e.hash, e.slot, e.generation))


def test_release_twice_never_goes_negative_and_only_drops_own_pins(store: Store) -> None:
    a, b = Runner(store, 1), Runner(store, 2)
    hashes = chain(prompt(1, 1))
    a.store_chain(hashes)
    a.hits(hashes, pin=True)
    b.hits(hashes, pin=True)
    assert store.release(NS, ALICE, a.lease, hashes, 3.0) == 5
    assert store.release(NS, ALICE, a.lease, hashes, 3.0) == 0
    stats = store.stats().namespaces[0]
    assert stats.pinned == 5  # b's pins are untouched
    assert all(info.refcount == 1 for info in store.iter_blocks(NS))
    assert store.release(NS, ALICE, b.lease, hashes, 4.0) == 5
    assert all(info.refcount == 0 for info in store.iter_blocks(NS))


def test_repeated_pins_by_one_lease_are_counted(store: Store) -> None:
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1))
    a.store_chain(hashes)
    a.hits(hashes, pin=True)
    a.hits(hashes, pin=True)
    store.release(NS, ALICE, a.lease, hashes, 3.0)
    assert store.stats().namespaces[0].pinned == 5
    store.release(NS, ALICE, a.lease, hashes, 3.0)
    assert store.stats().namespaces[0].pinned == 0


def test_eviction_takes_leaves_before_parents() -> None:
    store = small_store(16)
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1, system_blocks=3, user_blocks=2))
    a.store_chain(hashes, now=1.0)
    # The whole chain was touched at once: its deepest block goes first.
    assert store.table(NS).lru_order() == list(reversed(hashes))
    assert store.evict(NS, 2, 2.0) == 2
    assert a.hits(hashes, now=3.0) == 3


def test_committing_a_child_refreshes_its_ancestors() -> None:
    store = small_store(16)
    a = Runner(store, 1)
    base = prompt(1, 1, system_blocks=2, user_blocks=0)
    a.store_chain(chain(base), now=1.0)
    other = chain(prompt(5, 5, system_blocks=2, user_blocks=0))
    a.store_chain(other, now=2.0)
    longer = chain(base + list(range(800, 804)))
    a.store_chain(longer, now=3.0)
    order = store.table(NS).lru_order()
    # The other chain is now the oldest; the extended chain is newest, leaf first.
    assert order[:2] == list(reversed(other))
    assert order[2:] == list(reversed(longer))


def test_orphans_are_reclaimed_first() -> None:
    store = small_store(16)
    a, b = Runner(store, 1), Runner(store, 2)
    hashes = chain(prompt(1, 1, system_blocks=2, user_blocks=1))
    a.store_chain(hashes[:2], now=1.0)
    store.reserve(NS, ALICE, b.lease, hashes, 2.0)  # b writes the third block
    other = chain(prompt(3, 3, system_blocks=2, user_blocks=0))
    a.store_chain(other, now=3.0)
    assert store.evict(NS, 2, 4.0) == 2  # the first chain's two blocks go
    store.commit(NS, ALICE, b.lease, [hashes[2]], 5.0)
    # The child's parent is gone: no lookup reaches it, so it is next.
    assert store.table(NS).lru_order()[0] == hashes[2]
    assert a.hits(hashes, now=6.0) == 0


def test_relinked_parent_makes_an_orphan_reachable_again() -> None:
    store = small_store(16)
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1, system_blocks=1, user_blocks=1))
    a.store_chain(hashes, now=1.0)
    a.hits(hashes[1:], pin=False)  # no effect on order: not a prefix
    assert a.hits(hashes, pin=True, now=2.0) == 2
    store.release(NS, ALICE, a.lease, [hashes[0]], 3.0)
    store.evict(NS, 1, 3.5)  # evicts block 0 (the only evictable one)
    assert a.hits(hashes, now=4.0) == 0
    a.store_chain(hashes, now=5.0)  # block 0 stored again; block 1 still pinned
    assert a.hits(hashes, now=6.0) == 2
    infos = {i.hash: i for i in store.iter_blocks(NS)}
    assert infos[hashes[1]].parent == hashes[0]


def test_events_describe_stored_runs_and_removals(store: Store) -> None:
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1))
    a.store_chain(hashes[:2], now=1.0)
    a.store_chain(hashes, now=2.0)
    store.evict(NS, 1, 3.0)
    events = store.take_events()
    assert [e.kind for e in events] == [EventKind.STORED, EventKind.STORED, EventKind.REMOVED]
    assert events[0].hashes == tuple(hashes[:2]) and events[0].parent is None
    assert events[1].hashes == tuple(hashes[2:]) and events[1].parent == hashes[1]
    assert events[2].hashes == (hashes[-1],)
    assert store.take_events() == []


def test_clear_keeps_pinned_and_writing_blocks(store: Store) -> None:
    a = Runner(store, 1)
    pinned = chain(prompt(1, 1))
    a.store_chain(pinned)
    a.hits(pinned, pin=True)
    a.store_chain(chain(prompt(2, 1)))
    store.reserve(NS, ALICE, a.lease, chain(prompt(3, 1)), 2.0)
    report = store.clear(NS, 3.0)
    assert report.removed == 5  # chain 2's 5 blocks (chain 1's prefix is pinned)
    assert report.kept_pinned == 5 and report.kept_writing == 5
    assert store.take_events()[-1].kind is EventKind.CLEARED


def test_stats_count_tokens_and_miss_reasons(store: Store) -> None:
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1))
    a.store_chain(hashes[:3])
    store.lookup(NS, ALICE, hashes, 2.0, query_tokens=22)
    counters = store.stats().namespaces[0].tenants[ALICE]
    assert counters.hit_blocks == 3 and counters.miss_blocks == 2
    assert counters.hit_tokens == 12 and counters.miss_tokens == 10
    assert counters.miss_absent == 1 and counters.stored_blocks == 3


def test_bad_input_is_a_typed_error(store: Store) -> None:
    a = Runner(store, 1)
    with pytest.raises(InvalidArgument):
        store.lookup(NS, ALICE, [BlockHash(b"short")], 1.0)
    with pytest.raises(UnknownNamespace):
        store.lookup(NamespaceId("nope"), ALICE, [], 1.0)
    with pytest.raises(InvalidArgument):
        store.evict(NS, -1, 1.0)
    with pytest.raises(LayoutConflict):
        store.register_namespace(NamespaceSpec(SPEC.model_id, KVLayout(3, 2, 8, 4, "float16")), 8)
    assert store.register_namespace(SPEC, 999).capacity == 64  # idempotent
    too_long = Store(StoreLimits(max_chain_blocks=4))
    too_long.register_namespace(SPEC, 8)
    with pytest.raises(InvalidArgument, match="at most 4 blocks"):
        too_long.lookup(NS, ALICE, chain(prompt(1, 1)), 1.0)
    assert a.hits(chain(prompt(1, 1))) == 0


def test_pins_per_lease_are_bounded() -> None:
    store = small_store(16, max_pins_per_lease=6)
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1))
    a.store_chain(hashes)
    a.hits(hashes, pin=True)
    with pytest.raises(LimitExceeded, match="over the limit of 6"):
        a.hits(hashes, pin=True)
    assert store.stats().pinned_by_leases == 5


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_layers", 0), ("head_dim", -1), ("block_size", 0), ("dtype", "float64")],
)
def test_bad_layouts_are_rejected(field: str, value: object) -> None:
    kwargs: dict[str, object] = {
        "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float16"
    }  # fmt: skip
    kwargs[field] = value
    with pytest.raises(InvalidArgument):
        KVLayout(**kwargs)  # type: ignore[arg-type]


def test_evicting_a_tenants_last_block_while_it_reserves() -> None:
    # Found by the state machine: the eviction inside reserve emptied the
    # tenant's scope, and the new block went into a dict nobody held.
    store = small_store(1)
    a = Runner(store, 1)
    first = chain(prompt(1, 1, system_blocks=1, user_blocks=0))
    a.store_chain(first, now=1.0)
    other = chain(prompt(2, 1, system_blocks=1, user_blocks=0))
    assert a.store_chain(other, now=2.0) == 1
    assert a.hits(other, now=3.0) == 1
    assert len(list(store.iter_blocks(NS))) == 1


def test_a_latent_layout_holds_one_vector_per_token_and_layer() -> None:
    """MLA's order: no K/V split and one "head", so a block is half a K/V one of the
    same width; more than one head is refused (a latent has none)."""
    latent = KVLayout(3, 1, 576, 16, "bfloat16", kv_order="LATENT_LAYER_TOKEN")
    assert latent.kv_parts == 1
    assert latent.block_shape == (1, 3, 16, 1, 576)
    assert latent.block_bytes == 3 * 16 * 576 * 2
    assert KVLayout(3, 1, 576, 16, "bfloat16").block_bytes == 2 * latent.block_bytes
    with pytest.raises(InvalidArgument, match="num_kv_heads must be 1"):
        KVLayout(3, 2, 576, 16, "bfloat16", kv_order="LATENT_LAYER_TOKEN")
    with pytest.raises(InvalidArgument, match="kv_order"):
        KVLayout(3, 1, 576, 16, "bfloat16", kv_order="LATENT")
