"""Per-tenant lookup counters of one namespace, bounded in the number of tenants.

With auth off a client names its own tenant, so tenant names are unbounded.
`TenantCounterBook` keeps its own `TenantCounters` for the first
``limit`` tenants it sees and counts every later one under `OTHER_TENANTS`;
totals stay exact. The same folding applies to the resident-block counts
that stats report per scope, so a stats snapshot is bounded too.
"""

from __future__ import annotations

from kvstore.results import TenantCounters
from kvstore.types import SHARED_SCOPE, TenantId

OTHER_TENANTS = TenantId("_other")
"""Where tenants past the limit are counted (not a valid tenant name: no collision)."""


class TenantCounterBook:
    """Tenant → counters, at most ``limit`` tenants of their own (0 = unbounded)."""

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self._counters: dict[TenantId, TenantCounters] = {}

    def __len__(self) -> int:
        return len(self._counters)

    def of(self, tenant: TenantId) -> TenantCounters:
        """The counters ``tenant`` is counted in (created on first use)."""
        counters = self._counters.get(tenant)
        if counters is not None:
            return counters
        if self.limit and len(self._counters) >= self.limit:
            tenant = OTHER_TENANTS  # first come, first kept: a tenant's record never moves
            counters = self._counters.get(tenant)
            if counters is not None:
                return counters
        counters = self._counters[tenant] = TenantCounters()
        return counters

    def copies(self) -> dict[TenantId, TenantCounters]:
        """A copy of every record."""
        return {
            t: TenantCounters(**{f: getattr(c, f) for f in TenantCounters.__slots__})
            for t, c in self._counters.items()
        }

    def fold(self, resident: dict[TenantId, int]) -> dict[TenantId, int]:
        """Resident blocks per scope, scopes without a record of their own under `OTHER_TENANTS`.

        With made-up tenant names there can be as many scopes as blocks; folded,
        the rows are as bounded as the counters. The shared scope stays.
        """
        if not self.limit:
            return resident
        folded: dict[TenantId, int] = {}
        for scope, n in resident.items():
            key = scope if scope in self._counters or scope == SHARED_SCOPE else OTHER_TENANTS
            folded[key] = folded.get(key, 0) + n
        return folded
