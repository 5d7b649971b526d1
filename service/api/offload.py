"""Work too big for the event loop runs on a small pool of worker threads.

A handler must not hold the loop for more than a few milliseconds, or every
other call on the node waits (a lease keeper's KeepAlive among them). Pure
work whose size grows with the request (hashing a chain, turning tokens into
an array, building thousands of response messages) goes to `off_loop` once it
is bigger than ``inline`` items. Python code on a worker thread gives the GIL
back to the loop every switch interval (5 ms), which is what bounds the
loop's stall; C calls that would hold the GIL for long (one huge ``hashlib``
call) are cut into chunks by the callers.

Two workers: more would only compete with the loop for the GIL. Nothing run
here may touch the store, which lives on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

WORKERS = 2
"""Threads that run off-loop work; shared by all calls of the process."""

INLINE_ITEMS = 512
"""Work over this many items (tokens, blocks) leaves the loop."""

_pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="kvstore-work")


async def off_loop(size: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``: inline when ``size`` is at most `INLINE_ITEMS`, else on a worker thread.

    Exceptions (a `FieldError` among them) propagate to the awaiting handler.
    """
    if size <= INLINE_ITEMS:
        return fn(*args)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool, functools.partial(fn, *args))
