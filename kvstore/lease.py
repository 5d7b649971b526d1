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
- A release may carry an id (the client's, one per hit): a release whose id
  the lease has seen among its last `RELEASES_REMEMBERED` answers what it
  answered then and drops nothing, so a retried release never drops the pin
  another hit of the same lease holds on the same block.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvstore.block import Block
from kvstore.errors import InvalidArgument, LeaseExpired, LimitExceeded, UnknownLease
from kvstore.types import LeaseId, NamespaceId, TenantId

RELEASES_REMEMBERED = 4096
"""Release ids a lease remembers (the most recent): a retry of an older one is applied again."""

ENDED_MEMORY = 65536
"""How many ended lease ids are remembered to answer `LeaseExpired` rather
than `UnknownLease`."""


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
    releases: dict[int, int] | None = None
    """Release id -> pins that release dropped, the most recent last (None until the first)."""

    def released_before(self, release_id: int) -> int | None:
        """The pins release ``release_id`` dropped, if this lease applied it (recently)."""
        return None if self.releases is None else self.releases.get(release_id)

    def remember_release(self, release_id: int, count: int) -> None:
        """Record that release ``release_id`` dropped ``count`` pins (bounded memory)."""
        if self.releases is None:
            self.releases = {}
        self.releases[release_id] = count
        if len(self.releases) > RELEASES_REMEMBERED:
            del self.releases[next(iter(self.releases))]  # the oldest

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
