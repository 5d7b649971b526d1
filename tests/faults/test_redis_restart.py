"""Redis killed and restarted (empty): the directory converges to what the nodes hold.

tests/redis and tests/e2e/test_cluster.py show that local lookups keep being
answered during the outage and that blocks stored meanwhile are published
after it. What this adds: blocks *removed* during the outage (an operator's
Clear, evictions) are not resurrected, and after the restart every node's
directory set is exactly its READY blocks, so Locate credits each node with
what it really holds, no more and no less.
"""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from kvstore.v1 import kvstore_pb2 as pb
from service.cluster.directory import Directory
from service.cluster.keys import Keys, member
from tests.redis.nodes import NodeFactory
from tests.redis.rpc import Rpc
from tests.redis.server import REDIS_SERVER, RedisServer
from tests.waiting import until

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server on PATH")

KEYS = Keys("kvt")  # tests.redis.conftest.node_config's prefix


async def ready_members(rpc: Rpc) -> set[bytes]:
    """The directory members a node should publish: its READY blocks (ListBlocks)."""
    members: set[bytes] = set()
    token = ""
    while True:
        page = await rpc.stub.ListBlocks(
            pb.ListBlocksRequest(namespace_id=rpc.namespace, page_size=1000, page_token=token),
            metadata=rpc.md,
            timeout=5,
        )
        members |= {
            member(b.hash, b.tenant) for b in page.blocks if b.state == pb.BLOCK_STATE_READY
        }
        token = page.next_page_token
        if not token:
            return members


async def published(redis_url: str, namespace: str, node_id: str) -> set[bytes]:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=0.5)
    try:
        return set(await client.smembers(KEYS.ns_node(namespace, node_id)))
    except Exception:
        return set()
    finally:
        await client.aclose()


async def converged(redis_url: str, nodes: dict[str, Rpc]) -> bool:
    for node_id, rpc in nodes.items():
        if await published(redis_url, rpc.namespace, node_id) != await ready_members(rpc):
            return False
    return True


async def locate(redis_url: str, namespace: str, chain: list[bytes]) -> dict[str, int]:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=0.5)
    try:
        holders = await Directory(KEYS, "observer", 1000).locate(
            client, namespace, "default", chain, skip_self=False
        )
    finally:
        await client.aclose()
    return {h.node_id: h.blocks for h in holders}


async def _is(value, expected) -> bool:
    return await value == expected


async def located(redis_url: str, namespace: str, chain: list[bytes], holders: dict) -> None:
    """Until Locate credits exactly ``holders`` (the directory is eventually consistent:
    a node's liveness key comes with its next heartbeat)."""
    await until(lambda: _is(locate(redis_url, namespace, chain), holders), what=f"{holders}")


async def test_directory_converges_to_the_nodes_contents_after_a_redis_restart(tmp_path):
    redis_server = RedisServer(tmp_path / "redis").start()
    factory = NodeFactory(tmp_path, redis_server.url)
    rpcs: dict[str, Rpc] = {}
    try:
        for node_id in ("node-a", "node-b"):
            server = await factory.start(node_id, directory_queue_blocks=8)
            rpcs[node_id] = Rpc(server.address)
            await rpcs[node_id].register()
        a, b = rpcs["node-a"], rpcs["node-b"]
        kept = await a.store(seed=1, blocks=4)
        cleared = await b.store(seed=2, blocks=6)
        await until(lambda: converged(redis_server.url, rpcs), what="first sync")
        await located(redis_server.url, a.namespace, cleared, {"node-b": 6})

        redis_server.kill()
        await until(
            lambda: not any(s.node.cluster.connected for s in factory.servers),
            what="both nodes to notice the outage",
        )
        # During the outage: node-b loses everything (an operator's Clear), then
        # both nodes store new chains (more than the 8-block publish queue holds).
        assert (await b.stub.Clear(pb.ClearRequest(namespace_id=b.namespace), timeout=5)).removed
        assert (await b.lookup(2, 6)).hit_blocks == 0
        added_a = await a.store(seed=3, blocks=10)
        added_b = await b.store(seed=4, blocks=3)
        assert (await a.lookup(1, 4)).hit_blocks == 4  # local serving goes on

        redis_server.start()  # empty, as a restarted cache Redis is
        await until(lambda: converged(redis_server.url, rpcs), what="the directory to converge")
        # Locate answers match the nodes' contents: the cleared chain is credited to
        # nobody, the kept and new chains to their holders, in full.
        await located(redis_server.url, a.namespace, cleared, {})
        await located(redis_server.url, a.namespace, kept, {"node-a": 4})
        await located(redis_server.url, a.namespace, added_a, {"node-a": 10})
        await located(redis_server.url, a.namespace, added_b, {"node-b": 3})

        # And with Redis up, a removal reaches the directory too.
        await a.stub.Clear(pb.ClearRequest(namespace_id=a.namespace), timeout=5)
        await until(lambda: converged(redis_server.url, rpcs), what="the Clear to be published")
        await located(redis_server.url, a.namespace, kept, {})
    finally:
        for rpc in rpcs.values():
            await rpc.close()
        for server in list(factory.servers):
            await factory.stop(server)
        redis_server.stop()


async def _one_node_with_five_blocks(tmp_path):
    redis_server = RedisServer(tmp_path / "redis").start()
    factory = NodeFactory(tmp_path, redis_server.url)
    server = await factory.start("node-a")
    rpc = Rpc(server.address)
    await rpc.register()
    chain = await rpc.store(seed=1, blocks=5)
    await until(lambda: converged(redis_server.url, {"node-a": rpc}), what="first sync")
    await located(redis_server.url, rpc.namespace, chain, {"node-a": 5})
    return redis_server, factory, server, rpc, chain


async def test_a_redis_flushed_under_a_live_connection_gets_the_directory_back(tmp_path):
    """Issue 40, item 4, made deterministic: Redis loses everything with no command of
    the node ever failing (FLUSHALL on the same connection's server). The agent used to
    resync only after a failed command: the entry stayed at 0 of 5 blocks for good."""
    redis_server, factory, server, rpc, chain = await _one_node_with_five_blocks(tmp_path)
    agent = server.node.cluster
    try:
        resyncs = agent.resyncs
        with redis_server.client() as r:
            r.flushall()
        await located(redis_server.url, rpc.namespace, chain, {"node-a": 5})
        assert await converged(redis_server.url, {"node-a": rpc})
        assert agent.resyncs == resyncs + 1
    finally:
        await rpc.close()
        await factory.stop(server)
        redis_server.stop()


async def test_a_redis_restarted_empty_within_the_reconnect_window_is_resynchronised(tmp_path):
    """Issue 40, item 4 as reproduced: SIGKILL and an empty restart on the same port in
    tens of milliseconds, between two heartbeats, so redis-py's pool reconnects silently."""
    redis_server, factory, server, rpc, chain = await _one_node_with_five_blocks(tmp_path)
    try:
        for _ in range(3):
            redis_server.kill()
            redis_server.start()  # empty, within ~50 ms here
            await located(redis_server.url, rpc.namespace, chain, {"node-a": 5})
            assert await converged(redis_server.url, {"node-a": rpc})
    finally:
        await rpc.close()
        await factory.stop(server)
        redis_server.stop()
