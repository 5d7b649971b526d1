"""What a node starts for its disk tier: the promoter and the metrics (with `disk_path`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry

from kvstore.v1 import kvstore_pb2 as pb
from service.cluster.local import LocalNode
from service.disk.node_metrics import DiskCollector, DiskFigures
from service.disk.node_tier import NodeDisk
from service.disk.promote import DiskPromoter

T = TypeVar("T")

OnLoop = Callable[[Callable[[], T]], T | None]
"""Runs a read on the node's loop from any thread (`Node.on_loop`)."""


def start_disk(
    node: LocalNode, disk: NodeDisk, registry: CollectorRegistry, on_loop: OnLoop[DiskFigures]
) -> DiskPromoter:
    """Attach ``disk`` to ``node``, export its figures; returns the lookups' promoter."""
    disk.attach(node)
    promoter = DiskPromoter(node, disk, registry)

    def figures() -> DiskFigures:
        return DiskFigures(
            disk.stats(), dict(disk.skipped), promoter.promoted_blocks, promoter.timeouts
        )

    registry.register(DiskCollector(lambda: on_loop(figures)))
    return promoter


def disk_stats(disk: NodeDisk, promoter: DiskPromoter) -> pb.DiskTierStats:
    """The tier's figures in a StatsResponse; call on the loop."""
    stats = disk.stats()
    return pb.DiskTierStats(
        capacity_bytes=stats.capacity_bytes,
        used_bytes=stats.used_bytes,
        blocks=stats.blocks,
        promoted_blocks=promoter.promoted_blocks,
        written_blocks=stats.writes,
        dropped_writes=stats.write_drops + sum(disk.skipped.values()),
        degraded=stats.degraded,
    )
