"""Redis down at start, lost under load, back again: local lookups never fail; resync."""

from __future__ import annotations

import asyncio

from service.cluster.directory import Change, Directory, DirectoryQueue
from service.cluster.keys import Keys
from tests.redis.rpc import Rpc
from tests.redis.server import RedisServer, free_port
from tests.waiting import until

KEYS = Keys("kvt")


def test_queue_overflow_drops_and_asks_for_a_resync():
    queue = DirectoryQueue(limit_blocks=4)
    queue.needs_resync = False
    queue.put(Change.ADD, "ns", "t", [bytes(32)] * 3)
    assert queue.blocks == 3
    queue.put(Change.ADD, "ns", "t", [bytes(32)] * 2)
    assert queue.needs_resync and queue.blocks == 0 and queue.dropped == 5
    queue.put(Change.ADD, "ns", "t", [bytes(32)])  # ignored until the resync snapshot
    assert queue.blocks == 0


async def _held(server: RedisServer, ns: str, chain, node_id: str) -> int:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(server.url, socket_timeout=0.5)
    try:
        holders = await Directory(KEYS, "observer", 1000).locate(client, ns, "default", chain)
    except Exception:
        return -1
    finally:
        await client.aclose()
    return next((h.blocks for h in holders if h.node_id == node_id), 0)


async def test_redis_down_at_start_then_up(tmp_path):
    from tests.redis.nodes import NodeFactory

    server = RedisServer(tmp_path / "redis", free_port())
    factory = NodeFactory(tmp_path, server.url)
    a = await factory.start("node-a")
    ra = Rpc(a.address)
    try:
        ns = await ra.register()
        chain = await ra.store(seed=1, blocks=4)
        assert (await ra.lookup(1, 4, remote=True)).hit_blocks == 4  # local, Redis is down
        assert not a.node.cluster.connected
        server.start()
        await until(lambda: _is(_held(server, ns, chain, "node-a"), 4), what="first sync")
        assert a.node.cluster.resyncs >= 1
    finally:
        await ra.close()
        for s in list(factory.servers):
            await factory.stop(s)
        server.stop()


async def _is(value, expected) -> bool:
    return await value == expected


async def test_redis_killed_under_load_then_restarted_resyncs(tmp_path):
    from tests.redis.nodes import NodeFactory

    server = RedisServer(tmp_path / "redis").start()
    factory = NodeFactory(tmp_path, server.url)
    a = await factory.start("node-a", directory_queue_blocks=8)
    ra = Rpc(a.address)
    failures: list[BaseException] = []
    answered = 0
    stop = asyncio.Event()

    async def load() -> None:
        nonlocal answered
        while not stop.is_set():
            try:
                hit = await ra.lookup(1, 4, remote=True, deadline=5)
                assert hit.hit_blocks == 4
                answered += 1
            except BaseException as exc:
                failures.append(exc)
            await asyncio.sleep(0)

    try:
        ns = await ra.register()
        chain = await ra.store(seed=1, blocks=4)
        await until(lambda: _is(_held(server, ns, chain, "node-a"), 4), what="first sync")
        worker = asyncio.create_task(load())
        server.kill()
        await until(lambda: not a.node.cluster.connected, what="outage noticed")
        # While Redis is away: more blocks than the queue holds (overflow -> resync).
        chain2 = await ra.store(seed=2, blocks=12)
        before = answered
        await until(lambda: answered > before + 20, what="lookups during the outage")
        server.start()  # empty: everything must come back from the node's store
        await until(lambda: _is(_held(server, ns, chain2, "node-a"), 12), what="resync")
        assert await _held(server, ns, chain, "node-a") == 4
        stop.set()
        await worker
        assert failures == []
        assert answered > 20
    finally:
        stop.set()
        await ra.close()
        for s in list(factory.servers):
            await factory.stop(s)
        server.stop()
