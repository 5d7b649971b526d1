"""Lease rules: expiry, renewal, closing, and what each frees."""

from __future__ import annotations

import pytest

from kvstore import (
    InvalidArgument,
    LeaseExpired,
    LeaseId,
    LimitExceeded,
    NamespaceSpec,
    Store,
    StoreLimits,
    TenantId,
    UnknownLease,
)
from tests.kvstore.conftest import ALICE, BOB, NS, SPEC, Runner, chain, prompt


def test_expiry_drops_pins_and_aborts_writes(store: Store) -> None:
    a, b = Runner(store, 1), Runner(store, 2)
    stored = chain(prompt(1, 1))
    b.store_chain(stored)
    a.hits(stored, pin=True)
    store.reserve(NS, ALICE, a.lease, chain(prompt(2, 1)), 1.0)
    store.renew_lease(b.lease, ALICE, 5.0)  # b lives on
    report = store.expire(10.0)
    assert [r.lease_id for r in report.leases] == [a.lease]
    assert report.pins_dropped == 5 and report.writes_aborted == 5
    stats = store.stats()
    ns = stats.namespaces[0]
    assert ns.pinned == 0 and ns.writing == 0 and ns.ready == 5
    assert stats.leases == 1 and stats.leases_expired == 1


def test_a_dead_writer_does_not_block_the_key_forever(store: Store) -> None:
    dead, alive = Runner(store, 1), Runner(store, 2)
    hashes = chain(prompt(1, 1))
    store.reserve(NS, ALICE, dead.lease, hashes, 1.0)
    store.renew_lease(alive.lease, ALICE, 9.0)
    store.expire(10.0)
    assert alive.store_chain(hashes, now=11.0) == 5


def test_using_a_lease_past_its_deadline_fails_even_before_the_sweep(store: Store) -> None:
    a = Runner(store, 1)
    with pytest.raises(LeaseExpired):
        store.lookup(NS, ALICE, chain(prompt(1, 1)), 10.0, lease_id=a.lease)
    with pytest.raises(LeaseExpired):
        store.renew_lease(a.lease, ALICE, 10.0)
    store.expire(10.0)
    with pytest.raises(LeaseExpired):
        store.reserve(NS, ALICE, a.lease, chain(prompt(1, 1)), 11.0)


def test_renewal_moves_the_deadline(store: Store) -> None:
    a = Runner(store, 1)
    for t in range(1, 50):
        store.renew_lease(a.lease, ALICE, float(t))
    assert store.expire(58.0).leases == ()
    assert store.next_deadline() == 59.0
    assert [r.lease_id for r in store.expire(59.0).leases] == [a.lease]


def test_close_releases_everything_at_once(store: Store) -> None:
    a = Runner(store, 1)
    hashes = chain(prompt(1, 1))
    a.store_chain(hashes)
    a.hits(hashes, pin=True)
    a.hits(hashes, pin=True)
    report = store.close_lease(a.lease, ALICE, 2.0)
    assert report.pins_dropped == 10
    assert store.stats().namespaces[0].pinned == 0
    with pytest.raises(LeaseExpired):
        store.close_lease(a.lease, ALICE, 2.0)


def test_a_lease_is_invisible_to_other_tenants(store: Store) -> None:
    a = Runner(store, 1)
    with pytest.raises(UnknownLease):
        store.lookup(NS, BOB, chain(prompt(1, 1)), 1.0, lease_id=a.lease)
    with pytest.raises(UnknownLease):
        store.close_lease(LeaseId(12345), ALICE, 1.0)


def test_expiry_cost_is_proportional_to_what_the_lease_owns() -> None:
    # 20,000 READY blocks held by nobody and 1 expiring lease with 1 pin: the
    # sweep must not visit the blocks. Count the LRU operations it causes.
    # One chain of 20,000 blocks: over the default MAX_CHAIN_BLOCKS.
    store = Store(StoreLimits(max_chain_blocks=20_000))
    store.register_namespace(SPEC, capacity=20_001)
    filler = Runner(store, 1)
    tokens = list(range(20_000 * 4))
    filler.store_chain(chain(tokens), now=1.0)
    store.renew_lease(filler.lease, ALICE, 5.0)
    a = Runner(store, 2)
    one = chain([7, 7, 7, 7])
    a.store_chain(one)
    a.hits(one, pin=True)
    table = store.table(NS)
    touched: list[int] = []
    original = table._res.touch

    def counting_touch(blocks, now):  # type: ignore[no-untyped-def]
        blocks = list(blocks)
        touched.append(len(blocks))
        original(blocks, now)

    table._res.touch = counting_touch  # type: ignore[method-assign]
    report = store.expire(10.5)
    assert report.pins_dropped == 1
    assert sum(touched) == 1
    assert store.table(NS).lru_order()[-1] == one[0]


def test_ttl_and_lease_count_bounds() -> None:
    store = Store(StoreLimits(max_lease_ttl=60.0, max_leases_per_tenant=2))
    store.register_namespace(SPEC, 8)
    with pytest.raises(InvalidArgument):
        store.open_lease(LeaseId(1), ALICE, 0.0, 0.0)
    with pytest.raises(InvalidArgument):
        store.open_lease(LeaseId(1), ALICE, 61.0, 0.0)
    store.open_lease(LeaseId(1), ALICE, 10.0, 0.0)
    store.open_lease(LeaseId(2), ALICE, 10.0, 0.0)
    with pytest.raises(LimitExceeded):
        store.open_lease(LeaseId(3), ALICE, 10.0, 0.0)
    store.open_lease(LeaseId(4), TenantId("carol"), 10.0, 0.0)
    store.close_lease(LeaseId(1), ALICE, 1.0)
    store.open_lease(LeaseId(5), ALICE, 10.0, 1.0)


def _pinned_lookup(store: Store, runner: Runner, hashes: list, release_id: int) -> int:
    return store.lookup(
        NS, ALICE, hashes, 2.0, lease_id=runner.lease, release_id=release_id
    ).hit_blocks


def _lease_pins(store: Store, runner: Runner) -> int:
    return store.lease(runner.lease, ALICE, 3.0).pin_total


def test_a_retried_release_never_drops_another_hits_pins_however_late(store: Store) -> None:
    # #31 item 3: the node once remembered a lease's last 4,096 release ids; a
    # retry after more releases than that was applied again and dropped the
    # pins that hit 2 (same lease, same blocks) held. Pins are now named by
    # the lookup that took them, so a spent id drops nothing, ever.
    a = Runner(store, 1)
    stored = chain(prompt(1, 1))
    a.store_chain(stored)
    assert _pinned_lookup(store, a, stored, 11) == 5  # hit 1
    assert _pinned_lookup(store, a, stored, 12) == 5  # hit 2: two pins a block
    assert store.release(NS, ALICE, a.lease, stored, 3.0, release_id=11) == 5
    assert store.release(NS, ALICE, a.lease, stored, 3.0, release_id=11) == 5  # a quick retry
    other = chain(prompt(2, 2))
    a.store_chain(other)
    for i in range(5000):  # many more releases of other hits than any window
        assert _pinned_lookup(store, a, other[:1], 1000 + i) == 1
        assert store.release(NS, ALICE, a.lease, other[:1], 3.0, release_id=1000 + i) == 1
    assert store.release(NS, ALICE, a.lease, stored, 3.0, release_id=11) == 0  # a late retry
    assert store.stats().namespaces[0].pinned == 5  # hit 2 keeps its pins
    assert _lease_pins(store, a) == 5
    assert store.evict(NS, 100, 4.0) == len(other)  # hit 2's blocks cannot be evicted
    assert store.release(NS, ALICE, a.lease, stored, 4.0, release_id=12) == 5
    assert store.stats().namespaces[0].pinned == 0
    lease = store.lease(a.lease, ALICE, 4.0)
    assert not lease.pin_sets  # memory: O(live pin sets)


def test_a_release_id_drops_exactly_its_lookups_pins(store: Store) -> None:
    a = Runner(store, 1)
    stored = chain(prompt(1, 1))
    a.store_chain(stored)
    assert _pinned_lookup(store, a, stored[:2], 21) == 2
    assert _pinned_lookup(store, a, stored, 22) == 5
    # The hashes a release sends are not consulted when it names a pin set.
    assert store.release(NS, ALICE, a.lease, stored, 3.0, release_id=21) == 2
    assert _lease_pins(store, a) == 5
    assert store.release(NS, ALICE, a.lease, stored[:1], 3.0, release_id=22) == 5
    assert _lease_pins(store, a) == 0


def test_an_undeclared_release_id_drops_nothing_and_no_id_releases_by_hash(
    store: Store,
) -> None:
    a = Runner(store, 1)
    stored = chain(prompt(1, 1))
    a.store_chain(stored)
    a.hits(stored, pin=True)  # pinned without an id
    assert store.release(NS, ALICE, a.lease, stored, 3.0, release_id=99) == 0
    assert _lease_pins(store, a) == 5
    assert store.release(NS, ALICE, a.lease, stored, 3.0) == 5  # by hash, as before
    assert _lease_pins(store, a) == 0


def test_a_release_id_of_another_namespace_drops_nothing(store: Store) -> None:
    a = Runner(store, 1)
    stored = chain(prompt(1, 1))
    a.store_chain(stored)
    _pinned_lookup(store, a, stored, 5)
    other = NamespaceSpec("other-model", SPEC.layout)
    store.register_namespace(other, 8)
    assert store.release(other.namespace_id, ALICE, a.lease, stored, 3.0, release_id=5) == 0
    assert store.release(NS, ALICE, a.lease, stored, 3.0, release_id=5) == 5


def test_a_release_id_of_a_live_lookup_cannot_name_a_second_one(store: Store) -> None:
    a = Runner(store, 1)
    stored = chain(prompt(1, 1))
    a.store_chain(stored)
    _pinned_lookup(store, a, stored, 7)
    with pytest.raises(InvalidArgument, match="release_id 7"):
        _pinned_lookup(store, a, stored, 7)
    assert _lease_pins(store, a) == 5  # the refused lookup pinned nothing
    with pytest.raises(InvalidArgument):  # an id names pins: no lease, no id
        store.lookup(NS, ALICE, stored, 2.0, release_id=8)
    store.release(NS, ALICE, a.lease, stored, 3.0, release_id=7)
    assert _pinned_lookup(store, a, stored, 7) == 5  # spent: may name a new lookup
    assert store.release(NS, ALICE, a.lease, stored, 3.0, release_id=7) == 5
    assert _pinned_lookup(store, a, chain(prompt(9, 9)), 8) == 0  # nothing pinned, nothing kept
    assert not store.lease(a.lease, ALICE, 3.0).pin_sets


def test_a_lookup_undone_by_the_node_leaves_its_id_unspent(store: Store) -> None:
    a = Runner(store, 1)
    stored = chain(prompt(1, 1))
    a.store_chain(stored)
    result = store.lookup(NS, ALICE, stored, 2.0, lease_id=a.lease, release_id=3)
    assert store.unpin_lookup(NS, ALICE, a.lease, result, 2.0, release_id=3) == 5
    assert _lease_pins(store, a) == 0
    assert _pinned_lookup(store, a, stored, 3) == 5  # the caller's retry declares it again


def test_pin_sets_are_freed_with_the_lease_and_the_namespace(store: Store) -> None:
    a, b = Runner(store, 1), Runner(store, 2)
    stored = chain(prompt(1, 1))
    a.store_chain(stored)
    _pinned_lookup(store, a, stored, 1)
    _pinned_lookup(store, b, stored, 1)  # ids are per lease
    lease_b = store.lease(b.lease, ALICE, 3.0)
    store.drop_namespace(NS, 3.0, force=True)
    assert not lease_b.pin_sets
    store.register_namespace(SPEC, 64)
    a.store_chain(stored, now=4.0)
    _pinned_lookup(store, a, stored, 1)
    lease_a = store.lease(a.lease, ALICE, 4.0)
    assert lease_a.pin_sets
    store.close_lease(a.lease, ALICE, 4.0)
    assert not lease_a.pin_sets
    _pinned_lookup(store, b, stored, 1)
    lease_b = store.lease(b.lease, ALICE, 4.0)
    store.expire(20.0)
    assert not lease_b.pin_sets
