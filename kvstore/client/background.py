"""Cleanups that must finish even when the call that started them is cancelled.

A pinned lookup or a reservation cancelled mid-flight is finished here in
the background and its pins released or its slots aborted; `Client.close`
waits for what is still running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine, Iterator
from typing import Any

from kvstore.errors import KVStoreError

log = logging.getLogger(__name__)


class Background:
    """The client's background tasks."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` as a task kept until it ends."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cleanup(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a cleanup to its end even if the caller is cancelled again meanwhile."""
        await asyncio.shield(self.spawn(coro))

    def __iter__(self) -> Iterator[asyncio.Task[None]]:
        """The tasks running now (a snapshot)."""
        return iter(list(self._tasks))

    async def drain(self) -> None:
        """Wait for every task still running (their errors are logged, not raised)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def quietly(what: str, call: Awaitable[object]) -> None:
    """Await a cleanup call; a failure is logged, since the lease drops what it held anyway."""
    try:
        await call
    except KVStoreError as exc:  # the lease drops it anyway when it ends
        log.warning("%s failed (the lease will drop it): %s", what, exc)
