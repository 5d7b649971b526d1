"""The store as a state machine: random interleavings of every store operation from several leases.

After every step the invariants of ``kvstore.block_table`` must hold; at the
end every lease expires and nothing may stay pinned or WRITING. Alice has a
quota (bob has none), so the per-scope LRUs and the quota path are exercised
against the same invariants, plus "resident blocks per tenant <= quota".

Quarantine (late writers, ``docs/leases.md``): the slots an expired lease was
writing are modelled with their release time; no reservation may hand one
out before it, a closed lease's slots are never quarantined, and
``free + quarantined + ready + writing == capacity`` after every step.

Run by test_store_state_machine.py; test_capacity_state_machine.py extends it
(arenas added and given back).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore import (
    BlockState,
    FailedPrecondition,
    LeaseId,
    LimitExceeded,
    NotFound,
    NotWriter,
    Store,
    StoreLimits,
    TenantId,
)
from kvstore.types import BlockHash
from tests.kvstore.conftest import NS, SPEC, chain

CAPACITY = 12
TTL = 5.0
TENANTS = [TenantId("alice"), TenantId("bob")]
# Prompts over a tiny alphabet so that chains share prefixes often.
PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(
    lambda blocks: [t for b in blocks for t in [b, b + 1, b + 2, b + 3]]
)
LEASES = st.integers(0, 3)
QUOTA = {TenantId("alice"): 5}
QUARANTINE = 6.0


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = Store(StoreLimits(max_pins_per_lease=40, write_quarantine=QUARANTINE))
        self.store.register_namespace(SPEC, capacity=CAPACITY, quota=lambda t: QUOTA.get(t, 0))
        self.now = 0.0
        self.next_id = 1
        self.leases: dict[int, tuple[LeaseId, TenantId]] = {}
        self.pins: dict[LeaseId, Counter[BlockHash]] = {}
        self.quarantined: dict[int, float] = {}
        """Model: slot → release time, for slots taken from expired writers."""
        for slot in range(4):
            self._open(slot)

    def _open(self, slot: int) -> None:
        lease_id = LeaseId(self.next_id)
        self.next_id += 1
        tenant = TENANTS[slot % 2]
        self.store.open_lease(lease_id, tenant, TTL, self.now)
        self.leases[slot] = (lease_id, tenant)
        self.pins[lease_id] = Counter()

    def _chain(self, tokens: list[int], slot: int) -> list[BlockHash]:
        return chain(tokens, salt=self.leases[slot][1].encode())

    # --- rules -------------------------------------------------------------------

    @rule(tokens=PROMPTS, slot=LEASES, pin=st.booleans())
    def lookup(self, tokens: list[int], slot: int, pin: bool) -> None:
        lease_id, tenant = self.leases[slot]
        hashes = self._chain(tokens, slot)
        try:
            result = self.store.lookup(
                NS, tenant, hashes, self.now, lease_id=lease_id if pin else None
            )
        except (FailedPrecondition, LimitExceeded):
            return
        assert [b.hash for b in result.blocks] == hashes[: result.hit_blocks]
        states = {i.hash: i.state for i in self.store.iter_blocks(NS) if i.scope == tenant}
        for ref in result.blocks:
            assert states[ref.hash] is BlockState.READY, "lookup returned a non-READY block"
        if pin:
            self.pins[lease_id].update(b.hash for b in result.blocks)

    @rule(tokens=PROMPTS, slot=LEASES)
    def reserve(self, tokens: list[int], slot: int) -> None:
        lease_id, tenant = self.leases[slot]
        try:
            result = self.store.reserve(NS, tenant, lease_id, self._chain(tokens, slot), self.now)
        except FailedPrecondition:
            return
        for entry in result.reserved:
            until = self.quarantined.pop(entry.slot, None)
            assert until is None or until <= self.now, "a quarantined slot was reused early"

    @rule(slot=LEASES, data=st.data())
    def commit_some(self, slot: int, data: st.DataObject) -> None:
        lease_id, tenant = self.leases[slot]
        writing = [
            i.hash
            for i in self.store.iter_blocks(NS)
            if i.state is BlockState.WRITING and i.scope == tenant
        ]
        if not writing:
            return
        picked = data.draw(st.lists(st.sampled_from(writing), max_size=4))
        try:
            self.store.commit(NS, tenant, lease_id, picked, self.now)
        except (NotWriter, FailedPrecondition):
            return

    @rule(tokens=PROMPTS, slot=LEASES)
    def abort(self, tokens: list[int], slot: int) -> None:
        lease_id, tenant = self.leases[slot]
        try:
            self.store.abort(NS, tenant, lease_id, self._chain(tokens, slot), self.now)
        except FailedPrecondition:
            return

    @rule(tokens=PROMPTS, slot=LEASES)
    def release(self, tokens: list[int], slot: int) -> None:
        lease_id, tenant = self.leases[slot]
        hashes = self._chain(tokens, slot)
        try:
            released = self.store.release(NS, tenant, lease_id, hashes, self.now)
        except FailedPrecondition:
            return
        held = self.pins[lease_id]
        expected = 0
        for h in hashes:
            if held[h] > 0:
                held[h] -= 1
                expected += 1
        assert released == expected

    @rule(n=st.integers(0, 5))
    def evict(self, n: int) -> None:
        self.store.evict(NS, n, self.now)

    @rule()
    def evict_everything_evictable(self) -> None:
        # Walks past every pinned block at an LRU head (they stay resident and
        # come back to the LRU when their last pin goes).
        pinned = {i.hash for i in self.store.iter_blocks(NS) if i.refcount}
        self.store.evict(NS, CAPACITY, self.now)
        assert {i.hash for i in self.store.iter_blocks(NS) if i.state is BlockState.READY} == pinned

    @rule(dt=st.floats(0.0, 4.0))
    def advance(self, dt: float) -> None:
        self.now += dt
        self._expire()

    @rule(slot=LEASES)
    def renew_or_reopen(self, slot: int) -> None:
        lease_id, tenant = self.leases[slot]
        try:
            self.store.renew_lease(lease_id, tenant, self.now)
        except (FailedPrecondition, NotFound):
            self._expire()
            self._open(slot)

    @precondition(lambda self: True)
    @rule(slot=LEASES)
    def close(self, slot: int) -> None:
        lease_id, tenant = self.leases[slot]
        before = self._quarantine()
        try:
            report = self.store.close_lease(lease_id, tenant, self.now)
        except (FailedPrecondition, NotFound):
            return
        assert self._quarantine() == before, "a closed lease's slots were quarantined"
        assert report.pins_dropped == sum(self.pins.pop(lease_id).values())
        self._open(slot)

    def _writing_slots(self) -> set[int]:
        return {i.slot for i in self.store.iter_blocks(NS) if i.state is BlockState.WRITING}

    def _quarantine(self) -> list[tuple[float, int]]:
        return [(t, int(s)) for t, s in self.store.table(NS).quarantine_snapshot()]

    def _expire(self) -> None:
        writing = self._writing_slots()
        for report in self.store.expire(self.now).leases:
            assert report.pins_dropped == sum(self.pins.pop(report.lease_id).values())
        # Only expiry drops WRITING blocks here: those of the expired leases.
        for slot in writing - self._writing_slots():
            self.quarantined[slot] = self.now + QUARANTINE
        # The sweep frees every due slot.
        assert all(t > self.now for t, _ in self._quarantine())

    # --- invariants ------------------------------------------------------------------

    @invariant()
    def accounting_adds_up(self) -> None:
        stats = self.store.stats().namespaces[0]
        assert stats.free + stats.quarantined + stats.ready + stats.writing == CAPACITY
        assert stats.quarantined == len(self._quarantine())
        infos = list(self.store.iter_blocks(NS))
        assert len(infos) == stats.ready + stats.writing
        assert len({i.slot for i in infos}) == len(infos), "a slot owned by two blocks"
        assert all(0 <= i.slot < CAPACITY for i in infos)
        assert all(i.refcount >= 0 for i in infos)
        evictable = sum(1 for i in infos if i.state is BlockState.READY and i.refcount == 0)
        assert stats.evictable == evictable
        assert stats.pinned == sum(1 for i in infos if i.refcount > 0)
        # Every READY unpinned block is in the LRU (pinned ones may stay
        # linked, but eviction never offers them).
        unpinned = {i.hash for i in infos if i.state is BlockState.READY and i.refcount == 0}
        order = self.store.table(NS).lru_order()
        assert len(order) == len(set(order)) and set(order) == unpinned

    @invariant()
    def quarantined_slots_hold_nothing_until_their_time(self) -> None:
        held = {s for t, s in self._quarantine()}
        used = {i.slot for i in self.store.iter_blocks(NS)}
        assert not held & used, "a slot both quarantined and holding a block"
        for slot, until in self.quarantined.items():
            if until > self.now:
                assert slot in held, "a slot left quarantine before its release time"
                assert slot not in used

    @invariant()
    def resident_blocks_per_tenant_stay_within_quota(self) -> None:
        stats = self.store.stats().namespaces[0]
        per_scope = Counter(i.scope for i in self.store.iter_blocks(NS))
        assert dict(per_scope) == stats.resident_by_tenant
        for tenant, quota in QUOTA.items():
            assert per_scope[tenant] <= quota

    @invariant()
    def eviction_order_is_leaves_first_in_every_scope(self) -> None:
        # Reachable blocks (every ancestor resident) are evicted before their
        # parents; orphans are unreachable and go first in any order.
        infos = {i.hash: i for i in self.store.iter_blocks(NS)}

        def reachable(h: BlockHash) -> bool:
            parent = infos[h].parent
            return parent is None or (parent in infos and reachable(parent))

        seen: set[BlockHash] = set()
        for h in self.store.table(NS).lru_order():
            parent = infos[h].parent
            if reachable(h) and parent is not None:
                assert parent not in seen, "a parent is evicted before its child"
            seen.add(h)

    @invariant()
    def pins_match_the_model_and_pinned_blocks_stay(self) -> None:
        resident: dict[tuple[str, BlockHash], int] = {
            (i.scope, i.hash): i.refcount
            for i in self.store.iter_blocks(NS)
            if i.state is BlockState.READY
        }
        expected: Counter[tuple[str, BlockHash]] = Counter()
        tenant_of = {lease_id: tenant for lease_id, tenant in self.leases.values()}
        for lease_id, held in self.pins.items():
            for h, count in held.items():
                if count:
                    expected[(tenant_of[lease_id], h)] += count
        for key, count in expected.items():
            assert key in resident, "a pinned block was evicted"
            assert resident[key] == count
        assert sum(resident.values()) == sum(expected.values())

    def teardown(self) -> None:
        self.now += TTL + 1
        self._expire()
        stats = self.store.stats()
        ns = stats.namespaces[0]
        assert ns.pinned == 0 and ns.writing == 0
        assert stats.pinned_by_leases == 0 and stats.writing_by_leases == 0
        assert ns.free + ns.quarantined + ns.ready == CAPACITY
        self.now += QUARANTINE
        self._expire()
        ns = self.store.stats().namespaces[0]
        assert ns.quarantined == 0 and ns.free + ns.ready == CAPACITY
