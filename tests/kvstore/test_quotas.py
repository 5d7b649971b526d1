"""Per-tenant quotas and per-scope eviction of the block table."""

from __future__ import annotations

from kvstore import Store, TenantId
from kvstore.results import MissReason, ReserveStatus
from tests.kvstore.conftest import ALICE, BOB, NS, SPEC, Runner, chain

CAROL = TenantId("carol")


def quota_store(capacity: int, quotas: dict[TenantId, int]) -> Store:
    store = Store()
    store.register_namespace(SPEC, capacity=capacity, quota=lambda t: quotas.get(t, 0))
    return store


def resident(store: Store) -> dict[TenantId, int]:
    return store.stats().namespaces[0].resident_by_tenant


def test_tenant_at_quota_evicts_only_its_own_blocks() -> None:
    store = quota_store(capacity=8, quotas={ALICE: 3})
    bob = Runner(store, 1, BOB)
    bob_chain = chain(range(4 * 4), salt=b"bob")
    assert bob.store_chain(bob_chain, now=1.0) == 4  # older than anything of alice's
    alice = Runner(store, 2, ALICE)
    assert alice.store_chain(chain(range(3 * 4), salt=b"a1"), now=2.0) == 3
    # Alice is at quota; bob's blocks are the least recently used, yet only
    # alice's own make room.
    result = store.reserve(NS, ALICE, alice.lease, chain(range(2 * 4), salt=b"a2"), 3.0)
    assert [e.status for e in result.entries] == [ReserveStatus.RESERVED] * 2
    assert resident(store) == {BOB: 4, ALICE: 3}
    assert bob.hits(bob_chain, now=4.0) == 4


def test_tenant_at_quota_with_nothing_evictable_gets_no_room() -> None:
    store = quota_store(capacity=16, quotas={ALICE: 2})
    alice = Runner(store, 1, ALICE)
    first = chain(range(2 * 4), salt=b"a1")
    result = store.reserve(NS, ALICE, alice.lease, first, 1.0)  # WRITING: not evictable
    assert len(result.reserved) == 2
    more = store.reserve(NS, ALICE, alice.lease, chain(range(4), salt=b"a2"), 1.0)
    assert [e.status for e in more.entries] == [ReserveStatus.NO_ROOM]
    assert not more.complete
    # Bob has no quota and the pool has room: unaffected.
    bob = Runner(store, 2, BOB)
    assert bob.store_chain(chain(range(8 * 4), salt=b"b"), now=2.0) == 8


def test_quota_is_read_on_every_reservation() -> None:
    quotas = {ALICE: 1}
    store = quota_store(capacity=8, quotas=quotas)
    alice = Runner(store, 1, ALICE)
    assert alice.store_chain(chain(range(3 * 4), salt=b"a"), now=1.0) == 1
    quotas[ALICE] = 0  # quota lifted
    assert alice.store_chain(chain(range(3 * 4), salt=b"a"), now=2.0) == 2


def test_without_quota_the_victim_is_the_global_least_recently_used() -> None:
    store = quota_store(capacity=3, quotas={})
    alice, bob, carol = Runner(store, 1, ALICE), Runner(store, 2, BOB), Runner(store, 3, CAROL)
    a, b = chain(range(4), salt=b"a"), chain(range(4), salt=b"b")
    alice.store_chain(a, now=1.0)
    bob.store_chain(b, now=2.0)
    carol.store_chain(chain(range(4), salt=b"c"), now=3.0)
    assert alice.hits(a, now=4.0) == 1  # alice's block is now the most recent
    carol.store_chain(chain(range(4, 8), salt=b"c2"), now=5.0)
    assert bob.hits(b, now=6.0) == 0  # bob's was the oldest over all scopes
    assert alice.hits(a, now=6.0) == 1
    assert store.table(NS).lru_order()[0] != a[0]


def test_foreign_cached_prefix_looks_exactly_like_a_miss() -> None:
    store = quota_store(capacity=16, quotas={})
    alice, bob = Runner(store, 1, ALICE), Runner(store, 2, BOB)
    cached = chain(range(3 * 4), salt=b"same")  # bob even sends alice's exact hashes
    never = chain(range(100, 112), salt=b"same")
    alice.store_chain(cached, now=1.0)
    foreign = store.lookup(NS, BOB, cached, 2.0)
    absent = store.lookup(NS, BOB, never, 2.0)
    assert foreign == absent
    assert foreign.miss_reason is MissReason.ABSENT and foreign.hit_blocks == 0
    # Reserving it behaves like an uncached block: RESERVED, never HIT / IN_FLIGHT.
    result = store.reserve(NS, BOB, bob.lease, cached, 3.0)
    assert [e.status for e in result.entries] == [ReserveStatus.RESERVED] * 3
    # Alice writing the same hashes concurrently is not visible either.
    store.abort(NS, BOB, bob.lease, cached, 3.0)
    carol = Runner(store, 3, CAROL)
    store.reserve(NS, CAROL, carol.lease, never, 4.0)
    assert store.lookup(NS, BOB, never, 4.0) == absent
    # Bob's counters, not alice's, record his lookups.
    counters = store.stats().namespaces[0].tenants
    assert counters[ALICE].lookups == 0 and counters[BOB].lookups == 3
