"""A RegisterNamespace cancelled while its pool is being built does not break the next one.

Building a pool runs in a worker thread that cannot be stopped (prefaulting a
large pool takes seconds). A client whose deadline passes meanwhile and that
registers again must get its namespace, not INTERNAL because the first
thread still holds the pool's file names.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from tests.inproc import LAYOUT
from tests.waiting import until


async def test_register_again_after_a_cancelled_register(stub, kv_server):
    pools = kv_server.node.pools
    real_build = pools.build_arena
    started = threading.Event()
    release = threading.Event()
    calls = 0

    def slow_build(*args):
        nonlocal calls
        calls += 1
        pool = real_build(*args)
        if calls == 1:  # the first build created its files, then prefaults slowly
            started.set()
            release.wait(10)
        return pool

    pools.build_arena = slow_build  # type: ignore[method-assign]
    node = kv_server.node
    real_register = node.register
    registers = 0

    async def counted_register(*args, **kwargs):
        nonlocal registers
        registers += 1
        return await real_register(*args, **kwargs)

    node.register = counted_register  # type: ignore[method-assign]
    request = pb.RegisterNamespaceRequest(model_id="slow-model", layout=LAYOUT)
    first = stub.RegisterNamespace(request)
    assert await asyncio.to_thread(started.wait, 5)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first

    second = asyncio.ensure_future(stub.RegisterNamespace(request, timeout=10))
    # The second call reaches the node before the first build ends.
    await until(lambda: registers == 2, within=5.0, what="the second RegisterNamespace at the node")
    release.set()
    try:
        resp = await second
    except grpc.aio.AioRpcError as err:  # pragma: no cover - the failure this test guards
        pytest.fail(f"second RegisterNamespace failed: {err.code()} {err.details()}")
    assert resp.created and resp.capacity_blocks > 0
    # Exactly the second registration's pool is left, and it is usable.
    assert len(pools._pools) == 1
    attach = await stub.AttachPool(pb.AttachPoolRequest(namespace_id=resp.namespace_id))
    assert attach.arenas
