"""Lease rules: expiry, renewal, closing, and what each frees."""

from __future__ import annotations

import pytest

from kvstore import (
    InvalidArgument,
    LeaseExpired,
    LeaseId,
    LimitExceeded,
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
    store = Store()
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


def test_a_release_id_drops_pins_once_within_the_remembered_window(store: Store) -> None:
    from kvstore.lease import RELEASES_REMEMBERED

    a = Runner(store, 1)
    stored = chain(prompt(1, 1))
    a.store_chain(stored)
    a.hits(stored, pin=True)
    a.hits(stored, pin=True)  # two hits of one lease: two pins a block
    assert store.release(NS, ALICE, a.lease, stored, 3.0, release_id=11) == 5
    assert store.release(NS, ALICE, a.lease, stored, 3.0, release_id=11) == 5  # a retry
    assert store.stats().namespaces[0].pinned == 5  # the other hit keeps its pins
    for i in range(RELEASES_REMEMBERED):  # later releases push id 11 out of the window
        store.release(NS, ALICE, a.lease, stored[:0], 3.0, release_id=1000 + i)
    assert store.release(NS, ALICE, a.lease, stored, 3.0, release_id=11) == 5  # applied again
    assert store.stats().namespaces[0].pinned == 0
