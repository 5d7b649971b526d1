"""Leases: every pin and every WRITING slot belongs to one.

A runner opens a lease with a TTL and renews it while it lives. A runner that
dies (SIGKILL, OOM) stops renewing; once ``now`` passes the deadline,
`LeaseTable.pop_expired` hands the lease over and the store drops its pins
and aborts its writes. The cost is O(what that lease owns): the lease keeps
its own pins and writes, and deadlines sit in a heap, so no sweep over blocks
or over live leases ever happens.

Rules (also in ``docs/leases.md``):
- A lease is used only before its deadline; using it at or after the deadline
  raises `LeaseExpired` even if the sweep has not run yet.
- Pins are counted per (lease, block): two lookups pin twice, two releases
  unpin twice, a third release of the same block is a no-op. A release only
  ever drops the releasing lease's own pins.
- Closing a lease releases everything it holds, like expiry, but at once.
- Pins are named by the lookup that took them: a pinned lookup may declare a
  release id (the client's, one per hit), and the lease records that id ->
  the pins it took (a `PinSet`). A release naming the id drops exactly those
  pins, once, and forgets the id; a release naming an id that names no live
  pin set (spent, or never declared) drops nothing. So a retried release
  never drops the pin another hit of the same lease holds on the same block,
  however late the retry comes. Memory: O(live pin sets), freed on release,
  close and expiry; `ANSWERS_REMEMBERED` recent answers only let a retry get
  the same count back (correctness does not depend on them).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvstore.block import Block
from kvstore.errors import InvalidArgument, LeaseExpired, LimitExceeded, UnknownLease
from kvstore.types import BlockHash, LeaseId, NamespaceId, TenantId

ANSWERS_REMEMBERED = 1024
"""Spent release ids whose count a lease keeps (the most recent), so that a
retry gets the count the first attempt got; an older retry answers 0. Either
way a spent id drops nothing: this memory is for the answer only."""

ENDED_MEMORY = 65536
"""How many ended lease ids are remembered to answer `LeaseExpired` rather
than `UnknownLease`."""


@dataclass(frozen=True, slots=True)
class PinSet:
    """The pins one pinned lookup took, named by the release id it declared."""

    namespace: NamespaceId
    """The namespace the lookup ran in."""
    hashes: tuple[BlockHash, ...]
    """The blocks it pinned, one pin each (a chain from its first block)."""


@dataclass(slots=True, eq=False)
class Lease:
    """One runner's claim on pins and WRITING slots."""

    lease_id: LeaseId
    """Unguessable id chosen by the caller of `LeaseTable.open`."""
    tenant: TenantId
    """The tenant that opened it; only that tenant may use it."""
    ttl: float
    """Seconds a renewal extends the lease by."""
    deadline: float
    """`now` at or after which the lease is expired."""
    pins: dict[NamespaceId, set[Block]] = field(default_factory=dict)
    """Per namespace: the blocks this lease pins (once or more; a set, so a
    chain's pins are added and dropped in bulk, `kvstore.pins`)."""
    extra_pins: dict[NamespaceId, dict[Block, int]] = field(default_factory=dict)
    """Per namespace: pins beyond the first on a block (the same block pinned
    again by this lease), only while there are some."""
    writes: dict[NamespaceId, set[Block]] = field(default_factory=dict)
    """Per namespace: blocks reserved and not yet committed or aborted."""
    pin_total: int = 0
    """Pins held over all namespaces, counting repeats (bounded by config)."""
    internal: bool = False
    """Opened by the node itself (peer fetch): not counted against the tenant's lease limit."""
    pin_sets: dict[int, PinSet] = field(default_factory=dict)
    """Release id -> the pins the pinned lookup that declared it took, while live."""
    answers: dict[int, int] | None = None
    """Spent release id -> the pins its release dropped, the most recent last
    (at most `ANSWERS_REMEMBERED`; None until the first)."""

    def declare_pin_set(self, release_id: int) -> None:
        """Check that ``release_id`` may name a new pinned lookup's pins.

        Raises:
            InvalidArgument: a live pinned lookup of this lease declared it already.
        """
        if release_id in self.pin_sets:
            raise InvalidArgument(
                f"release_id {release_id} already names the pins of another live lookup "
                f"of lease {self.lease_id}; choose a new id per pinned lookup"
            )

    def add_pin_set(
        self, release_id: int, namespace: NamespaceId, hashes: tuple[BlockHash, ...]
    ) -> None:
        """Record the pins a lookup took under ``release_id`` (checked by `declare_pin_set`)."""
        self.declare_pin_set(release_id)
        self.pin_sets[release_id] = PinSet(namespace, hashes)
        if self.answers is not None:
            self.answers.pop(release_id, None)  # declared again: no longer spent

    def take_pin_set(self, release_id: int, namespace: NamespaceId) -> PinSet | None:
        """Remove and return the live pin set ``release_id`` names in ``namespace``, if any."""
        pin_set = self.pin_sets.get(release_id)
        if pin_set is None or pin_set.namespace != namespace:
            return None
        del self.pin_sets[release_id]
        return pin_set

    def answered(self, release_id: int) -> int:
        """What the release of spent id ``release_id`` dropped, if remembered; else 0."""
        return 0 if self.answers is None else self.answers.get(release_id, 0)

    def remember_answer(self, release_id: int, count: int) -> None:
        """Record that the release of ``release_id`` dropped ``count`` pins (bounded memory)."""
        if self.answers is None:
            self.answers = {}
        self.answers[release_id] = count
        if len(self.answers) > ANSWERS_REMEMBERED:
            del self.answers[next(iter(self.answers))]  # the oldest

    def forget_pin_sets(self, namespace: NamespaceId | None = None) -> None:
        """Drop the record of the pin sets (in ``namespace``; None: all): their pins are gone.

        Cost: O(the lease's pin sets), each of which holds at least one pin.
        """
        if namespace is None:
            self.pin_sets.clear()
            self.answers = None
            return
        for release_id in [i for i, p in self.pin_sets.items() if p.namespace == namespace]:
            del self.pin_sets[release_id]

    def pins_in(self, namespace: NamespaceId) -> set[Block]:
        """The blocks this lease pins in one namespace (created on first use)."""
        pins = self.pins.get(namespace)
        if pins is None:
            pins = self.pins[namespace] = set()
        return pins

    def pin_count(self, namespace: NamespaceId, block: Block) -> int:
        """How many pins this lease holds on ``block`` (0 when none)."""
        if block not in self.pins.get(namespace, ()):
            return 0
        return 1 + self.extra_pins.get(namespace, {}).get(block, 0)

    def writes_in(self, namespace: NamespaceId) -> set[Block]:
        """This lease's WRITING blocks in one namespace (created on first use)."""
        writes = self.writes.get(namespace)
        if writes is None:
            writes = self.writes[namespace] = set()
        return writes

    @property
    def write_total(self) -> int:
        """Blocks WRITING under this lease over all namespaces."""
        return sum(len(w) for w in self.writes.values())


class LeaseTable:
    """Live leases, their deadlines, and the ids of recently ended ones."""

    def __init__(
        self,
        *,
        max_ttl: float = 3600.0,
        max_leases_per_tenant: int = 0,
        max_leases_of: Callable[[TenantId], int] | None = None,
    ) -> None:
        self._leases: dict[LeaseId, Lease] = {}
        self._deadlines: list[tuple[float, LeaseId]] = []
        self._ended: OrderedDict[LeaseId, None] = OrderedDict()
        self._per_tenant: dict[TenantId, int] = {}
        self.max_ttl = max_ttl
        self.max_leases_per_tenant = max_leases_per_tenant
        self._max_leases_of = max_leases_of

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._leases.values()))

    def open(
        self, lease_id: LeaseId, tenant: TenantId, ttl: float, now: float, *, internal: bool = False
    ) -> Lease:
        """Create a lease that lives ``ttl`` seconds unless renewed.

        ``internal``: the node's own lease on the tenant's behalf (peer
        fetch); it is not counted against the tenant's lease limit (the node
        bounds those itself).
        """
        if not 0 < ttl <= self.max_ttl:
            raise InvalidArgument(f"lease ttl must be in (0, {self.max_ttl}] seconds, got {ttl}")
        if lease_id in self._leases or lease_id in self._ended:
            raise RuntimeError(f"bug: lease id {lease_id} issued twice")
        count = self._per_tenant.get(tenant, 0)
        limit = self._max_leases_of(tenant) if self._max_leases_of is not None else 0
        limit = limit or self.max_leases_per_tenant
        if limit and count >= limit and not internal:
            raise LimitExceeded(
                f"tenant {tenant!r} already holds {count} leases (limit {limit}); close some first"
            )
        lease = Lease(
            lease_id=lease_id, tenant=tenant, ttl=ttl, deadline=now + ttl, internal=internal
        )
        self._leases[lease_id] = lease
        if not internal:
            self._per_tenant[tenant] = count + 1
        heapq.heappush(self._deadlines, (lease.deadline, lease_id))
        return lease

    def get(self, lease_id: LeaseId, tenant: TenantId, now: float) -> Lease:
        """The live lease with this id, checked against tenant and deadline.

        Raises:
            LeaseExpired: the lease ended, or its deadline has passed.
            UnknownLease: no such lease (or it belongs to another tenant: a
                tenant cannot learn other tenants' lease ids).
        """
        lease = self._leases.get(lease_id)
        if lease is None or lease.tenant != tenant:
            if lease is None and lease_id in self._ended:
                raise LeaseExpired(f"lease {lease_id} has expired or was closed")
            raise UnknownLease(f"no lease {lease_id} on this node")
        if now >= lease.deadline:
            raise LeaseExpired(
                f"lease {lease_id} expired {now - lease.deadline:.3f}s ago; open a new one"
            )
        return lease

    def renew(self, lease_id: LeaseId, tenant: TenantId, now: float) -> Lease:
        """Push the deadline to ``now + ttl``."""
        lease = self.get(lease_id, tenant, now)
        lease.deadline = now + lease.ttl
        heapq.heappush(self._deadlines, (lease.deadline, lease_id))
        self._compact_heap()
        return lease

    def remove(self, lease: Lease) -> None:
        """Forget a lease (closed or expired); its holdings are the caller's to drop."""
        del self._leases[lease.lease_id]
        if not lease.internal:
            self._per_tenant[lease.tenant] -= 1
            if not self._per_tenant[lease.tenant]:
                del self._per_tenant[lease.tenant]
        self._ended[lease.lease_id] = None
        if len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)

    def pop_expired(self, now: float) -> list[Lease]:
        """Remove and return every lease whose deadline is at or before ``now``.

        Cost: O(log n) per heap entry popped; stale entries left by renewals
        are skipped and the heap is compacted when they dominate.
        """
        expired: list[Lease] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, lease_id = heapq.heappop(self._deadlines)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.deadline == deadline:
                self.remove(lease)
                expired.append(lease)
        return expired

    def next_deadline(self) -> float | None:
        """Earliest deadline among live leases (for the service's timer)."""
        while self._deadlines:
            deadline, lease_id = self._deadlines[0]
            lease = self._leases.get(lease_id)
            if lease is not None and lease.deadline == deadline:
                return deadline
            heapq.heappop(self._deadlines)
        return None

    def _compact_heap(self) -> None:
        # Every renewal leaves a stale entry behind; rebuild once they are
        # more than half of the heap so memory stays O(live leases).
        if len(self._deadlines) > 2 * len(self._leases) + 64:
            self._deadlines = [(lease.deadline, lease.lease_id) for lease in self._leases.values()]
            heapq.heapify(self._deadlines)
