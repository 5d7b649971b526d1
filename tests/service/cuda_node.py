"""A cache node on the fake CUDA runtime, served from its own thread.

Blocking clients (`SyncClient`, the transformers integration) cannot share
the test's event loop with an in-process node, so this node runs its own
loop in a daemon thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.pool import set_default_runtime
from service.config import Config
from service.server import Server
from tests.kvstore.pool.fake_cuda import FakeCudaRuntime


@contextmanager
def threaded_node(config: Config, runtime: FakeCudaRuntime) -> Iterator[Server]:
    """A started `Server` whose pools (and this process's mappings) use ``runtime``."""
    set_default_runtime(runtime)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-node", daemon=True)
    thread.start()
    server = Server(config, expiry_tick=0.02)
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
        try:
            yield server
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(0.1), loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        set_default_runtime(None)
