"""The engine index on Redis: one SET per (namespace, node, engine) and a HASH of engines.

The keys a router-side reader (the prefix-query RPC of another node) uses:
``{P:ns}:e:<node>:<engine>`` holds ``hash || scope`` members like the
node's own set, expires with the node TTL, and is deleted on a graceful
leave together with the ``{P:ns}:engines`` field.
"""

from __future__ import annotations

import hashlib
import json

import redis.asyncio as aioredis

from service.cluster.keys import Keys, member
from tests.redis.nodes import node_config
from tests.redis.rpc import Rpc, prompt
from tests.redis.server import RedisServer
from tests.vllm_events.fake_engine import FakeEngine, batch, removed, stored
from tests.vllm_events.ingest import join, start_node
from tests.waiting import until


def eh(i: int) -> bytes:
    return hashlib.sha256(b"redis-engine-%d" % i).digest()


async def test_engine_sets_on_redis(tmp_path, redis_server) -> None:
    engine = FakeEngine()
    config = node_config(tmp_path, redis_server.url, "n1")
    server = await start_node(config, engine, name="gpu-7")
    rpc = Rpc(server.address)
    client = aioredis.Redis.from_url(redis_server.url)
    keys = Keys("kvt")
    try:
        ns = await rpc.register()
        chain = await rpc.store(seed=3, blocks=3)
        tokens = prompt(3, 3)
        index = server.node.engine_index
        assert index is not None
        state = index.engines["gpu-7"]
        engine.keep(0, batch([stored([eh(0), eh(1), eh(2)], None, tokens)]))
        seq = await join(engine, state, 1)
        set_key = keys.ns_engine(ns, "n1", "gpu-7")
        want = {member(h, "default") for h in chain}

        async def members() -> set[bytes]:
            return set(await client.smembers(set_key))

        async def poll(expected: set[bytes]) -> None:
            await until(members, ok=expected.__eq__, what=f"engine set {expected}")

        await poll(want)
        assert 0 < await client.pttl(set_key) <= int(config.node_ttl_seconds * 1000)
        field = json.loads(await client.hget(keys.ns_engines(ns), "n1:gpu-7"))
        assert field == {"node": "n1", "engine": "gpu-7", "medium": "GPU"}

        engine.send(seq, batch([removed([eh(2)])]))
        await poll(want - {member(chain[2], "default")})

        # A dead node's engine field is swept by a live node's heartbeat; ours stays.
        await client.hset(keys.ns_engines(ns), "ghost-node:gpu-0", "{}")
        await until(
            lambda: client.hexists(keys.ns_engines(ns), "ghost-node:gpu-0"),
            ok=lambda present: not present,
            interval=0.02,
            what="the dead node's engine field to be swept",
        )
        assert await client.hexists(keys.ns_engines(ns), "n1:gpu-7")
    finally:
        await rpc.close()
        await server.stop(0.1)
        engine.close()
    # A graceful leave removes the engine's entries.
    assert not await client.exists(set_key)
    assert not await client.hexists(keys.ns_engines(ns), "n1:gpu-7")
    await client.aclose()


async def test_engine_sets_come_back_after_a_redis_outage(tmp_path) -> None:
    server_r = RedisServer(tmp_path / "redis").start()
    engine = FakeEngine()
    server = await start_node(node_config(tmp_path, server_r.url, "n2"), engine, name="gpu-8")
    rpc = Rpc(server.address)
    keys = Keys("kvt")
    try:
        ns = await rpc.register()
        chain = await rpc.store(seed=5, blocks=4)
        tokens = prompt(5, 4)
        index = server.node.engine_index
        agent = server.node.cluster
        assert index is not None and agent is not None
        state = index.engines["gpu-8"]
        engine.keep(0, batch([stored([eh(10), eh(11)], None, tokens[:8])]))
        seq = await join(engine, state, 1)
        set_key = keys.ns_engine(ns, "n2", "gpu-8")
        await _until_members(server_r, set_key, {member(h, "default") for h in chain[:2]})

        server_r.kill()
        await until(lambda: not agent.connected, what="the outage noticed")
        engine.send(seq, batch([stored([eh(12), eh(13)], eh(11), tokens[8:])]))
        await until(lambda: len(index.blocks("gpu-8")) == 4, what="ingest during the outage")
        server_r.start()  # empty: the engine set must come back from the index
        await _until_members(server_r, set_key, {member(h, "default") for h in chain})
    finally:
        await rpc.close()
        await server.stop(0.1)
        engine.close()
        server_r.stop()


async def _until_members(redis_proc: RedisServer, key: str, expected: set[bytes]) -> None:
    client = aioredis.Redis.from_url(redis_proc.url)
    try:

        async def members() -> set[bytes]:
            return set(await client.smembers(key))

        await until(members, ok=expected.__eq__, within=15, what=f"{key} to hold {expected}")
    finally:
        await client.aclose()
