"""Prometheus figures of the KV-event publisher and the engine index, read at scrape time.

- ``kvstore_kv_events_published_batches_total``, ``_dropped_batches_total``:
  batches the node sent on its PUB socket, and those dropped because the
  sender thread fell behind;
- ``kvstore_engine_blocks{engine, medium}``: blocks each engine holds;
- ``kvstore_engine_events_total{engine, kind}``: per engine, batches and
  blocks stored / removed, clears, restarts, replays, gaps, and every skip
  reason (docs/events.md, "Re-keying"), so a stream that cannot be indexed
  shows without reading logs.

The scrape runs on the metrics thread; the index lives on the event loop, so
its figures are copied there (`Figures`, a callable the node provides;
`service.ops.figures.FiguresCollector`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from service.ops.figures import FiguresCollector


@dataclass(frozen=True, slots=True)
class EventFigures:
    """One consistent copy of the figures, taken on the loop."""

    published: int | None = None
    """Batches sent (None: publishing is off)."""
    dropped: int = 0
    blocks: dict[tuple[str, str], int] = field(default_factory=dict)
    """(engine, medium) -> blocks."""
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    """(engine, kind) -> count."""


Figures = Callable[[], EventFigures | None]
"""Returns the figures (None: the node is stopping)."""


class EventsCollector(FiguresCollector[EventFigures]):
    """Exports `EventFigures` at each scrape."""

    def metrics(self, figures: EventFigures) -> Iterator[Metric]:
        if figures.published is not None:
            yield CounterMetricFamily(
                "kvstore_kv_events_published_batches",
                "Batches of the node's block events sent in vLLM's KV-event format",
                value=figures.published,
            )
            yield CounterMetricFamily(
                "kvstore_kv_events_dropped_batches",
                "Batches of KV events dropped because the sender thread fell behind",
                value=figures.dropped,
            )
        if not figures.blocks and not figures.counts:
            return
        blocks = GaugeMetricFamily(
            "kvstore_engine_blocks",
            "Blocks a serving engine holds, from its KV events",
            labels=["engine", "medium"],
        )
        for (engine, medium), n in sorted(figures.blocks.items()):
            blocks.add_metric([engine, medium], n)
        yield blocks
        counts = CounterMetricFamily(
            "kvstore_engine_events",
            "Per engine: batches, blocks stored/removed, clears, restarts, gaps and skips",
            labels=["engine", "kind"],
        )
        for (engine, kind), n in sorted(figures.counts.items()):
            counts.add_metric([engine, kind], n)
        yield counts
