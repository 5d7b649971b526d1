"""Prometheus figures of the disk tier, read at scrape time (docs/disk.md, "Metrics").

The tier's counters live on the event loop, so the node copies them there
(`DiskFigures`, taken by a callable the node provides) and the metrics
thread only formats them (`service.ops.figures.FiguresCollector`). The
promotion latency histogram is observed by `service.disk.promote` directly;
checksum failures go to the node's ``kvstore_checksum_failures_total{tier="disk"}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from service.disk.tier import DiskStats
from service.ops.figures import FiguresCollector


@dataclass(frozen=True, slots=True)
class DiskFigures:
    """One consistent copy of the tier's figures and the node's, taken on the loop."""

    stats: DiskStats
    """The tier's own snapshot."""
    skipped: Mapping[str, int]
    """Committed blocks the node did not offer, per reason (`node_tier.SKIP_REASONS`)."""
    promoted: int
    """Blocks read back into memory (disk hits)."""
    promote_timeouts: int
    """Lookups that stopped waiting for their promotion."""


Figures = Callable[[], DiskFigures | None]
"""Returns the figures (None: the node is stopping)."""


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"kvstore_disk_{name}", doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"kvstore_disk_{name}", doc, value=value)


class DiskCollector(FiguresCollector[DiskFigures]):
    """Exports `DiskFigures` at each scrape as ``kvstore_disk_*``."""

    def metrics(self, figures: DiskFigures) -> Iterator[Metric]:
        s = figures.stats
        yield _gauge(
            "capacity_bytes", "The disk tier's cap (disk_capacity_bytes)", s.capacity_bytes
        )
        yield _gauge("bytes", "Bytes of the disk tier's slots that hold a block", s.used_bytes)
        yield _gauge("blocks", "Blocks on the disk tier", s.blocks)
        yield _gauge("queue_depth", "Writes queued or in flight to the disk tier", s.queue_depth)
        yield _gauge("degraded", "1 once a write failed (ENOSPC, EIO): no more writes", s.degraded)
        yield _counter(
            "hits", "Blocks read back from disk into memory (promoted)", figures.promoted
        )
        yield _counter("writes", "Blocks written to the disk tier", s.writes)
        yield _counter("write_bytes", "Payload bytes written to the disk tier", s.write_bytes)
        yield _counter("reads", "Blocks read back from disk and verified", s.reads)
        yield _counter("evictions", "Blocks evicted from the disk tier to make room", s.evictions)
        yield _counter("enospc", "Disk tier writes that failed with ENOSPC", s.enospc)
        yield _counter(
            "promotion_timeouts",
            "Lookups that stopped waiting for blocks from disk (disk_promote_timeout)",
            figures.promote_timeouts,
        )
        drops = CounterMetricFamily(
            "kvstore_disk_write_drops",
            "Committed blocks not written to disk, by reason (queue: the tier's queue was full "
            "or it is degraded; backlog, moved, dropped, error: skipped by the node)",
            labels=["reason"],
        )
        drops.add_metric(["queue"], s.write_drops)
        for reason, count in figures.skipped.items():
            drops.add_metric([reason], count)
        yield drops
        failures = CounterMetricFamily(
            "kvstore_disk_read_failures",
            "Disk reads that were a miss, by reason (checksum, identity: discarded; error: EIO)",
            labels=["reason"],
        )
        failures.add_metric(["checksum"], s.read_failures_checksum)
        failures.add_metric(["identity"], s.read_failures_identity)
        failures.add_metric(["error"], s.read_errors)
        yield failures
        yield _counter("write_errors", "Disk tier writes that failed (EIO, ENOSPC)", s.write_errors)
        yield _gauge(
            "rebuilt_blocks", "Blocks found on disk when the tier opened", s.rebuilt_blocks
        )
        yield _gauge(
            "rebuild_seconds", "Seconds the index rebuild took at start", s.rebuild_seconds
        )
