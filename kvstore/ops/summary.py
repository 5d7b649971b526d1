"""Plain-JSON views of a node's `StatsResponse`: what ``kvstore status``,
``namespaces`` and ``tenants`` print with ``--json``, and what the node's
web page polls (one shape for both, so scripts and the page agree).
"""

from __future__ import annotations

from typing import Any

from kvstore.v1 import kvstore_pb2 as pb


def ratio(hits: int, misses: int) -> float | None:
    """hits / (hits + misses), or None when nothing was looked up."""
    total = hits + misses
    return hits / total if total else None


def tenant_json(namespace: str, t: pb.TenantStats) -> dict[str, Any]:
    """One tenant's counters in one namespace."""
    return {
        "namespace": namespace,
        "tenant": t.tenant,
        "lookups": t.lookups,
        "hit_tokens": t.hit_tokens,
        "miss_tokens": t.miss_tokens,
        "hit_blocks": t.hit_blocks,
        "miss_blocks": t.miss_blocks,
        "hit_rate_tokens": ratio(t.hit_tokens, t.miss_tokens),
        "hit_rate_blocks": ratio(t.hit_blocks, t.miss_blocks),
        "miss_absent": t.miss_absent,
        "miss_in_flight": t.miss_in_flight,
        "stored_blocks": t.stored_blocks,
        "resident_blocks": t.resident_blocks,
    }


def namespace_json(ns: pb.NamespaceStats) -> dict[str, Any]:
    """One namespace's occupancy and hit rates."""
    hit_t = sum(t.hit_tokens for t in ns.tenants)
    miss_t = sum(t.miss_tokens for t in ns.tenants)
    hit_b = sum(t.hit_blocks for t in ns.tenants)
    miss_b = sum(t.miss_blocks for t in ns.tenants)
    return {
        "namespace": ns.namespace_id,
        "model": ns.model_id,
        "block_size": ns.block_size,
        "block_bytes": ns.block_bytes,
        "shared": ns.shared,
        "capacity_blocks": ns.capacity,
        "used_blocks": ns.ready + ns.writing,
        "ready_blocks": ns.ready,
        "writing_blocks": ns.writing,
        "pinned_blocks": ns.pinned,
        "evictable_blocks": ns.evictable,
        "free_blocks": ns.free,
        "evictions": ns.evictions,
        "tenants": len(ns.tenants),
        "hit_tokens": hit_t,
        "miss_tokens": miss_t,
        "hit_blocks": hit_b,
        "miss_blocks": miss_b,
        "hit_rate_tokens": ratio(hit_t, miss_t),
        "hit_rate_blocks": ratio(hit_b, miss_b),
    }


def status_json(stats: pb.StatsResponse, target: str = "") -> dict[str, Any]:
    """The node-wide summary of ``kvstore status``."""
    namespaces = [namespace_json(ns) for ns in stats.namespaces]

    def total(key: str) -> int:
        return sum(int(ns[key]) for ns in namespaces)

    used_bytes = sum((ns.ready + ns.writing) * ns.block_bytes for ns in stats.namespaces)
    return {
        "node_id": stats.node_id,
        "target": target,
        "version": stats.version,
        "pool_kind": stats.pool_kind,
        "pool_epoch": stats.pool_epoch,
        "uptime_seconds": stats.uptime_seconds,
        "capacity_bytes": stats.capacity_bytes,
        "allocated_bytes": stats.allocated_bytes,
        "used_bytes": used_bytes,
        "capacity_blocks": total("capacity_blocks"),
        "used_blocks": total("used_blocks"),
        "pinned_blocks": total("pinned_blocks"),
        "writing_blocks": total("writing_blocks"),
        "evictions": total("evictions"),
        "leases": stats.leases,
        "leases_expired": stats.leases_expired,
        "pins": stats.pinned,
        "hit_tokens": total("hit_tokens"),
        "miss_tokens": total("miss_tokens"),
        "hit_blocks": total("hit_blocks"),
        "miss_blocks": total("miss_blocks"),
        "hit_rate_tokens": ratio(total("hit_tokens"), total("miss_tokens")),
        "hit_rate_blocks": ratio(total("hit_blocks"), total("miss_blocks")),
        "namespaces": namespaces,
        "disk": disk_json(stats.disk) if stats.HasField("disk") else None,
    }


def disk_json(disk: pb.DiskTierStats) -> dict[str, Any]:
    """The disk tier below the pools (docs/disk.md)."""
    return {
        "capacity_bytes": disk.capacity_bytes,
        "used_bytes": disk.used_bytes,
        "blocks": disk.blocks,
        "promoted_blocks": disk.promoted_blocks,
        "written_blocks": disk.written_blocks,
        "dropped_writes": disk.dropped_writes,
        "degraded": disk.degraded,
    }


def tenants_json(stats: pb.StatsResponse, namespace: str = "") -> list[dict[str, Any]]:
    """Every (namespace, tenant) row, optionally of one namespace."""
    return [
        tenant_json(ns.namespace_id, t)
        for ns in stats.namespaces
        if not namespace or ns.namespace_id == namespace
        for t in ns.tenants
    ]
