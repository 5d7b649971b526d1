"""The bounds of one node's store: what keeps one client from exhausting it.

`StoreLimits` is what the node passes the store from its settings (chain
length, pins, leases, namespaces, per-tenant counters) and how long the slots
of an expired writer rest before reuse (`WRITE_QUARANTINE`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.types import MAX_CHAIN_BLOCKS

WRITE_QUARANTINE = 300.0
"""Default seconds a slot taken from an expired writer rests before reuse.

A lease expires because its runner stopped renewing: it died, or it is
stalled (suspended, swapped out, stuck in a long synchronous call) and may
wake up in the middle of a copy into the slot. The SDK checks its lease
before each block copy, so such a late write can only come from a copy that
had started before the lease ran out; five minutes outlasts any copy of one
block by orders of magnitude, and costs only the few slots a dead runner was
writing (``docs/leases.md``, "Late writers")."""


@dataclass(frozen=True, slots=True)
class StoreLimits:
    """Bounds that keep one client from exhausting the node."""

    max_chain_blocks: int = MAX_CHAIN_BLOCKS
    """Longest chain one call may name (the node passes its ``max_chain_blocks`` setting)."""
    max_pins_per_lease: int = 0
    """Pins one lease may hold at once (0 = unbounded)."""
    max_leases_per_tenant: int = 0
    """Live leases per tenant (0 = unbounded)."""
    max_lease_ttl: float = 3600.0
    """Longest TTL a lease may ask for, in seconds."""
    max_namespaces: int = 64
    """Namespaces one node holds."""
    write_quarantine: float = WRITE_QUARANTINE
    """Seconds the slots of an expired lease's unfinished writes stay unused (0 = none)."""
    max_tenant_counters: int = 0
    """Tenants with their own lookup counters per namespace; the rest share one (0 = no bound)."""
