"""Two core options the peer-fetch path needs: a lookup that leaves no trace, internal leases."""

from __future__ import annotations

import pytest

from kvstore import LeaseId, LimitExceeded, Store, StoreLimits
from tests.kvstore.conftest import ALICE, NS, SPEC, Runner, chain, prompt


def test_a_peek_counts_nothing_and_moves_nothing_in_the_lru(store: Store) -> None:
    writer = Runner(store, 1)
    old, new = chain(prompt(1, 1)), chain(prompt(2, 1))
    writer.store_chain(old, now=1.0)
    writer.store_chain(new, now=2.0)
    table = store.table(NS)
    lru = table.lru_order()
    counters = table.stats().tenants[ALICE]
    hits = {b.hash: (b.hits, b.last_used) for b in table.iter_blocks()}
    result = store.lookup(NS, ALICE, old, 3.0, peek=True)
    assert result.hit_blocks == len(old)
    assert table.lru_order() == lru
    assert table.stats().tenants[ALICE] == counters
    assert {b.hash: (b.hits, b.last_used) for b in table.iter_blocks()} == hits
    # A plain lookup does count and refresh: the peek is what differs.
    store.lookup(NS, ALICE, old, 3.0)
    assert table.lru_order() != lru
    assert table.stats().tenants[ALICE].lookups == counters.lookups + 1


def test_internal_leases_are_outside_the_tenant_lease_limit() -> None:
    store = Store(StoreLimits(max_leases_per_tenant=1))
    store.register_namespace(SPEC, capacity=16)
    store.open_lease(LeaseId(1), ALICE, 10.0, 0.0)
    with pytest.raises(LimitExceeded):
        store.open_lease(LeaseId(2), ALICE, 10.0, 0.0)
    store.open_lease(LeaseId(3), ALICE, 10.0, 0.0, internal=True)
    store.close_lease(LeaseId(3), ALICE, 1.0)
    # Closing the internal lease did not free a slot of the tenant's own count.
    with pytest.raises(LimitExceeded):
        store.open_lease(LeaseId(4), ALICE, 10.0, 1.0)
    store.close_lease(LeaseId(1), ALICE, 1.0)
    store.open_lease(LeaseId(5), ALICE, 10.0, 1.0)
