"""In-process fan-out of cache events to ``WatchEvents`` streams.

Each watcher owns a bounded `asyncio.Queue`. Publishing never blocks and
never waits on a watcher: when a watcher's queue is full its oldest event is
dropped to make room (counted in `dropped`), so one slow watcher cannot
stall the RPCs that produce events, nor grow memory without bound. Closing
the hub ends every watcher's stream (shutdown).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

T = TypeVar("T")

WATCH_QUEUE_SIZE = 1024
"""Events buffered per watcher before the oldest are dropped."""


class Watcher(Generic[T]):
    """One subscription; iterate it to receive events until the hub closes."""

    def __init__(
        self,
        hub: WatchHub[T],
        namespace: str,
        maxsize: int,
        accept: Callable[[T], bool] | None = None,
    ) -> None:
        self._hub = hub
        self.namespace = namespace
        self.accept = accept
        """Filter applied before queueing (a tenant's own events only)."""
        self.maxsize = maxsize
        # Unbounded queue, bounded by `offer`: the end-of-stream marker must
        # always fit, and must never push out an event.
        self.queue: asyncio.Queue[T | None] = asyncio.Queue()
        self.dropped = 0

    def offer(self, item: T) -> None:
        """Enqueue without blocking, dropping the oldest item when full."""
        while self.queue.qsize() >= self.maxsize:
            self.queue.get_nowait()
            self.dropped += 1
            self._hub.dropped += 1
        self.queue.put_nowait(item)

    def end(self) -> None:
        """Mark the end of the stream (after what is queued)."""
        self.queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[T]:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            yield item

    def close(self) -> None:
        """Unsubscribe."""
        self._hub.unsubscribe(self)


class WatchHub(Generic[T]):
    """Fans each published event out to the watchers of its namespace."""

    def __init__(self, maxsize: int = WATCH_QUEUE_SIZE) -> None:
        self.maxsize = maxsize
        self.dropped = 0
        self._watchers: set[Watcher[T]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._watchers)

    def subscribe(
        self, namespace: str = "", accept: Callable[[T], bool] | None = None
    ) -> Watcher[T]:
        """Watch one namespace's events ("" = every namespace) that ``accept`` lets through."""
        watcher = Watcher(self, namespace, self.maxsize, accept)
        if self._closed:
            watcher.end()
        else:
            self._watchers.add(watcher)
        return watcher

    def unsubscribe(self, watcher: Watcher[T]) -> None:
        """Stop delivering to ``watcher``; idempotent."""
        self._watchers.discard(watcher)

    def publish(self, namespace: str, item: T) -> None:
        """Deliver ``item`` to every watcher of ``namespace`` and of every namespace."""
        for watcher in self._watchers:
            if (not watcher.namespace or watcher.namespace == namespace) and (
                watcher.accept is None or watcher.accept(item)
            ):
                watcher.offer(item)

    def close(self) -> None:
        """End every watcher's stream; later subscriptions end at once."""
        self._closed = True
        for watcher in self._watchers:
            watcher.end()
        self._watchers.clear()
