"""The tier's I/O in flight: a count, and a wait until it is zero.

`DiskTier` counts every write from its reservation to its completion and
every batch of header invalidations from its submit to its answer; `flush`
waits here until none is left. Loop-only: `begin` and `end` run on the event
loop's thread (the I/O threads report through `Completions`), so a plain
count and one `asyncio.Event`, made on first wait, are enough.
"""

from __future__ import annotations

import asyncio


class InFlight:
    """Writes and invalidations started and not yet done; `wait_idle` for none."""

    def __init__(self) -> None:
        self.count = 0
        """Started and not yet ended."""
        self._idle: asyncio.Event | None = None

    def begin(self) -> None:
        """One more in flight."""
        self.count += 1
        if self._idle is not None:
            self._idle.clear()

    def end(self) -> None:
        """One fewer in flight; wakes `wait_idle` at zero."""
        self.count -= 1
        if self.count == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:  # noqa: ASYNC109 (a bool, not a raise)
        """Wait until nothing is in flight; False if ``timeout`` ran out."""
        if self.count == 0:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
