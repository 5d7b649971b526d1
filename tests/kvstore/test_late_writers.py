"""A writer whose lease expired never gets its slot handed to another block early.

The corruption this guards against (issue #13): runner A reserves a slot and
starts copying into the mapped pool; A stalls long enough for its lease to
expire; the node frees the slot, tenant B reserves and commits a block in
it; A wakes up and finishes its copy: B's READY block now holds A's bytes.
A `bytearray` stands in for the pool so the tests can make the late copy.
"""

from __future__ import annotations

import pytest

from kvstore import LeaseExpired, LeaseId, NotWriter, Store, StoreLimits
from kvstore.limits import WRITE_QUARANTINE
from kvstore.results import ReserveResult, ReserveStatus
from kvstore.types import SlotId

from .conftest import ALICE, BOB, NS, SPEC, chain, prompt

BLOCK_BYTES = SPEC.layout.block_bytes
TTL = 10.0


class Pool:
    """Bytes of a small pool, addressed by slot, as a runner's mapping would be."""

    def __init__(self, capacity: int) -> None:
        self.memory = bytearray(capacity * BLOCK_BYTES)

    def write(self, slot: SlotId, fill: int) -> None:
        self.memory[slot * BLOCK_BYTES : (slot + 1) * BLOCK_BYTES] = bytes([fill]) * BLOCK_BYTES

    def read(self, slot: SlotId) -> bytes:
        return bytes(self.memory[slot * BLOCK_BYTES : (slot + 1) * BLOCK_BYTES])


def no_room(result: ReserveResult) -> int:
    return sum(1 for e in result.entries if e.status is ReserveStatus.NO_ROOM)


def small_store(capacity: int, limits: StoreLimits | None = None) -> Store:
    store = Store(limits)
    store.register_namespace(SPEC, capacity=capacity)
    return store


def counts_add_up(store: Store, capacity: int) -> None:
    ns = store.stats().namespaces[0]
    assert ns.free + ns.quarantined + ns.ready + ns.writing == capacity


def test_a_late_copy_of_an_expired_writer_never_lands_in_another_tenants_block() -> None:
    capacity = 4
    store, pool = small_store(capacity), Pool(capacity)
    a, b = LeaseId(1), LeaseId(2)
    store.open_lease(a, ALICE, TTL, now=0.0)
    [late] = store.reserve(NS, ALICE, a, chain(prompt(1, 1, 1, 0)), 1.0).reserved
    # A stalls before its copy; its lease runs out and the node sweeps it.
    report = store.expire(TTL + 1)
    assert report.writes_aborted == 1

    # B asks for the whole pool: it gets every slot but A's.
    store.open_lease(b, BOB, 100.0, now=TTL + 2)
    hashes = chain(prompt(2, 2, 4, 0), salt=b"bob-salt")
    result = store.reserve(NS, BOB, b, hashes, TTL + 2)
    got = [e.slot for e in result.reserved]
    assert late.slot not in got
    assert len(got) == capacity - 1 and no_room(result) == 1
    for slot in got:
        pool.write(slot, 0xBB)
    store.commit(NS, BOB, b, [e.hash for e in result.reserved], TTL + 3)

    pool.write(late.slot, 0xAA)  # A wakes up and finishes its copy
    hit = store.lookup(NS, BOB, hashes, TTL + 4, lease_id=b)
    assert hit.hit_blocks == capacity - 1
    assert all(pool.read(ref.slot) == b"\xbb" * BLOCK_BYTES for ref in hit.blocks)
    ns = store.stats().namespaces[0]
    assert (ns.free, ns.quarantined, ns.ready, ns.writing) == (0, 1, capacity - 1, 0)
    counts_add_up(store, capacity)


def test_a_quarantined_slot_is_reused_after_its_time_and_after_free_slots() -> None:
    capacity = 3
    store = small_store(capacity)
    a, b = LeaseId(1), LeaseId(2)
    store.open_lease(a, ALICE, TTL, now=0.0)
    [late] = store.reserve(NS, ALICE, a, chain(prompt(1, 1, 1, 0)), 1.0).reserved
    store.expire(TTL)
    store.open_lease(b, BOB, 10 * WRITE_QUARANTINE, now=TTL)
    bob = chain(prompt(2, 2, 3, 0), salt=b"bob-salt")
    # Just before the release time: still quarantined, never handed out.
    first = store.reserve(NS, BOB, b, bob, TTL + WRITE_QUARANTINE - 0.001)
    assert late.slot not in [e.slot for e in first.reserved]
    assert no_room(first) == 1
    # From the release time on it is an ordinary free slot again.
    second = store.reserve(NS, BOB, b, bob, TTL + WRITE_QUARANTINE)
    assert [e.slot for e in second.reserved][-1] == late.slot
    assert store.table(NS).generation(late.slot) > late.generation
    ns = store.stats().namespaces[0]
    assert (ns.free, ns.quarantined, ns.writing) == (0, 0, capacity)


def test_under_memory_pressure_reserve_evicts_or_reports_no_room_rather_than_reuse_early() -> None:
    capacity = 2
    store = small_store(capacity)
    a, b = LeaseId(1), LeaseId(2)
    store.open_lease(a, ALICE, TTL, now=0.0)
    store.open_lease(b, BOB, 1000.0, now=0.0)
    cached = chain(prompt(3, 3, 1, 0), salt=b"bob-salt")
    [kept] = store.reserve(NS, BOB, b, cached, 1.0).reserved
    store.commit(NS, BOB, b, cached, 1.0)
    [late] = store.reserve(NS, ALICE, a, chain(prompt(1, 1, 1, 0)), 1.0).reserved
    store.expire(TTL)
    # The pool's only usable room is bob's cached block: evicted, not A's slot taken.
    [fresh] = store.reserve(NS, BOB, b, chain(prompt(4, 4, 1, 0), salt=b"bob-salt"), 20).reserved
    assert fresh.slot == kept.slot != late.slot
    # Now nothing is evictable (WRITING + quarantined): a shortfall, not early reuse.
    result = store.reserve(NS, BOB, b, chain(prompt(5, 5, 1, 0), salt=b"bob-salt"), 21)
    assert result.reserved == () and no_room(result) == 1


def test_the_sweep_frees_due_slots_so_stats_show_them_free() -> None:
    store = small_store(4)
    store.open_lease(LeaseId(1), ALICE, TTL, now=0.0)
    store.reserve(NS, ALICE, LeaseId(1), chain(prompt(1, 1, 2, 0)), 1.0)
    store.expire(TTL)
    assert store.stats().namespaces[0].quarantined == 2
    store.expire(TTL + WRITE_QUARANTINE)
    ns = store.stats().namespaces[0]
    assert (ns.free, ns.quarantined) == (4, 0)


def test_a_closed_lease_or_an_abort_frees_at_once_least_recently_freed_first() -> None:
    capacity = 4
    store = small_store(capacity)
    a = LeaseId(1)
    store.open_lease(a, ALICE, TTL, now=0.0)
    hashes = chain(prompt(1, 1, 2, 0))
    aborted = [e.slot for e in store.reserve(NS, ALICE, a, hashes, 1.0).reserved]
    assert store.abort(NS, ALICE, a, hashes, 1.0) == 2
    store.reserve(NS, ALICE, a, chain(prompt(2, 2, 1, 0)), 1.0)
    store.close_lease(a, ALICE, 2.0)
    assert store.stats().namespaces[0].quarantined == 0
    # The slots freed just now wait behind the ones that were never used.
    b = LeaseId(2)
    store.open_lease(b, BOB, TTL, now=3.0)
    [nxt] = store.reserve(NS, BOB, b, chain(prompt(3, 3, 1, 0), salt=b"bob-salt"), 3.0).reserved
    assert nxt.slot not in aborted


def test_quarantine_zero_frees_at_once() -> None:
    store = small_store(1, StoreLimits(write_quarantine=0.0))
    store.open_lease(LeaseId(1), ALICE, TTL, now=0.0)
    store.reserve(NS, ALICE, LeaseId(1), chain(prompt(1, 1, 1, 0)), 1.0)
    store.expire(TTL)
    store.open_lease(LeaseId(2), BOB, TTL, now=TTL)
    result = store.reserve(NS, BOB, LeaseId(2), chain(prompt(2, 2, 1, 0), b"bob-salt"), TTL)
    assert len(result.reserved) == 1


def test_commit_checks_the_committing_lease_still_owns_the_writing_block() -> None:
    store = small_store(4)
    a, a2, b = LeaseId(1), LeaseId(2), LeaseId(3)
    store.open_lease(a, ALICE, TTL, now=0.0)
    store.open_lease(a2, ALICE, 1000.0, now=0.0)
    hashes = chain(prompt(1, 1, 1, 0))
    [first] = store.reserve(NS, ALICE, a, hashes, 1.0).reserved
    # Past the deadline the lease commits nothing, even before the sweep ran.
    with pytest.raises(LeaseExpired):
        store.commit(NS, ALICE, a, hashes, TTL)
    store.expire(TTL)
    # Another lease of the same tenant writes the same block in a new slot;
    # the expired lease cannot commit it, not even by its hash.
    [second] = store.reserve(NS, ALICE, a2, hashes, TTL + 1).reserved
    assert (second.slot, second.generation) != (first.slot, first.generation)
    with pytest.raises(LeaseExpired):
        store.commit(NS, ALICE, a, hashes, TTL + 1)
    # A live lease that aborted its reservation cannot commit the block that
    # someone else reserved since under the same hash.
    store.abort(NS, ALICE, a2, hashes, TTL + 2)
    store.open_lease(b, ALICE, 1000.0, now=TTL + 2)
    store.reserve(NS, ALICE, b, hashes, TTL + 2)
    with pytest.raises(NotWriter):
        store.commit(NS, ALICE, a2, hashes, TTL + 3)
    assert store.commit(NS, ALICE, b, hashes, TTL + 3) == 1
