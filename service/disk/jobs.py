"""What the disk tier's I/O threads run, and how their results reach the loop.

The thread side of `DiskTier`: `service.disk.writes` and `service.disk.reads` touch only
the file, the buffers and the values they are given (never the index), and
`Completions` carries results back to the event loop's thread with one
wake-up for however many completed meanwhile: a ``call_soon_threadsafe`` per
I/O cost more loop time than the rest of a 256 KiB read.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from service.disk.format import PAGE
from service.disk.index import Reservation
from service.disk.io import aligned


class ReadResult(IntEnum):
    OK = 0
    IDENTITY = 1
    """The header does not name the block (torn, overwritten, short)."""
    CHECKSUM = 2
    """The payload does not have its checksum."""
    ERROR = 3
    """The read failed (EIO)."""


@dataclass(slots=True)
class ReadBatch:
    """Reads asked for together: the last to land wakes the loop once (`finish`)."""

    results: list[ReadResult | None]
    left: int
    done: asyncio.Future[None]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def finish(self) -> None:
        """On the loop: every read of the batch has landed."""
        if not self.done.done():
            self.done.set_result(None)


@dataclass(slots=True, eq=False)
class PendingWrite:
    """A slot reserved for a block whose bytes the caller copies (`DiskTier.reserve_write`)."""

    done: Completions
    res: Reservation
    buf: Any
    """The slot's page-aligned buffer: header page, then the payload."""
    length: int
    checksum: int
    handed: bool = False
    """Submitted or cancelled (once)."""

    @property
    def payload(self) -> memoryview:
        """Where the block's ``length`` bytes go (writable from any thread until handed)."""
        return memoryview(self.buf)[PAGE : PAGE + self.length]


class ThreadBuffers(threading.local):
    """Each I/O thread's header page, zero page and bounce buffer, reused."""

    def __init__(self) -> None:
        self.page = aligned(PAGE)
        self.zero = aligned(PAGE)
        self.bounce = aligned(PAGE)

    def bounce_of(self, nbytes: int) -> Any:
        if len(self.bounce) < nbytes:
            self.bounce.close()
            self.bounce = aligned(nbytes)
        return self.bounce


class WriteBuffers:
    """Page-aligned write buffers by slot size, kept for reuse (up to ``keep``
    per size: the queue's bound, the most that are in use at once)."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: dict[int, list[Any]] = {}

    def take(self, slot_bytes: int) -> Any:
        free = self._free.get(slot_bytes)
        return free.pop() if free else aligned(slot_bytes)

    def give_back(self, slot_bytes: int, buf: Any) -> None:
        free = self._free.setdefault(slot_bytes, [])
        if len(free) < self._keep:
            free.append(buf)
        else:
            buf.close()


class Completions:
    """Callbacks from I/O threads, run on the loop's thread in the order posted,
    with one ``call_soon_threadsafe`` for all that queue while none is pending."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._scheduled = False

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """From any thread: run ``fn(*args)`` on the loop soon."""
        self._items.append((fn, args))  # deque.append is atomic
        if not self._scheduled:
            # Two threads may both get here: a second drain finds nothing, no harm.
            self._scheduled = True
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
                self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        # Cleared before popping: an item posted from here on schedules another drain.
        self._scheduled = False
        items = self._items
        while items:
            fn, args = items.popleft()
            fn(*args)
