"""Prometheus collectors of figures that live on the event loop, read at scrape time.

The scrape runs on the metrics thread; a component's figures live on the
event loop, so the node copies them there (a callable it provides, which
runs the copy on the loop and returns None while the node is stopping) and
the collector only formats the copy. `FiguresCollector` is that contract;
a subclass says how its figures become metric families (`metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

T = TypeVar("T")


class FiguresCollector(Collector, Generic[T]):
    """Exports one consistent copy of figures at each scrape; nothing while stopping."""

    def __init__(self, figures: Callable[[], T | None]) -> None:
        """``figures``: returns the copy taken on the loop (None: the node is stopping)."""
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        figures = self._figures()
        if figures is not None:
            yield from self.metrics(figures)

    def metrics(self, figures: T) -> Iterable[Metric]:
        """The metric families of one copy of the figures."""
        raise NotImplementedError
