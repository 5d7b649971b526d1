"""`ShardedClient`: several nodes as one cache, each chain on the node its
first block hashes to (`kvstore.client.sharded`)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import numpy as np
import pytest

from kvstore.client import Client, ShardedClient, shard_of
from kvstore.errors import FailedPrecondition, InvalidArgument
from service.config import Config
from service.server import Server
from tests.client.blocks import LAYOUT
from tests.inproc import ManualClock

NODES = 3
PROMPTS = 24


@pytest.fixture
async def nodes(server_config: Config) -> AsyncIterator[list[Server]]:
    servers = []
    for i in range(NODES):
        config = dataclasses.replace(
            server_config, pool_prefix=f"{server_config.pool_prefix}n{i}", node_id=f"node-{i}"
        )
        server = Server(config, clock=ManualClock(), expiry_tick=0.02)
        await server.start()
        servers.append(server)
    try:
        yield servers
    finally:
        for server in servers:
            await server.stop(0.1)


def prompt(i: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(3 * LAYOUT.block_size + 1)]  # 3 blocks and 1


def blocks(i: int) -> np.ndarray:
    return np.full((3, LAYOUT.block_bytes), i, np.uint8)


async def test_chains_spread_over_the_nodes_and_are_found_where_they_were_stored(nodes):
    targets = [n.address for n in nodes]
    async with ShardedClient(targets, tenant="acme", timeout=5.0) as kv:
        ns = await kv.register_namespace("m", LAYOUT)
        for i in range(PROMPTS):
            assert (await kv.store(ns, prompt(i), blocks(i))).committed == 3
        per_node = [s.namespaces[0].ready for s in await kv.stats()]
        assert sum(per_node) == 3 * PROMPTS and all(per_node), per_node  # every node has some
        for i in range(PROMPTS):
            chain = ns.hash(prompt(i))
            home = shard_of(chain[0], NODES)
            assert kv.shard_of(ns, prompt(i)) == kv.shard_of(ns, hashes=chain) == home
            hit = await kv.lookup(ns, prompt(i), pin=True)
            assert hit.hit_blocks == 3 and hit.namespace is ns.parts[home]
            assert [bytes(v) for v in hit.numpy_views()] == [bytes(b) for b in blocks(i)]
            assert await kv.release(hit) == 3
            # A longer prompt that extends it goes to the same node and hits its prefix.
            longer = prompt(i) + list(range(2 * LAYOUT.block_size))
            assert (await kv.lookup(ns, longer)).hit_blocks == 3
        assert sum(s.pinned for s in await kv.stats()) == 0
    # Another client with the same list in the same order finds the same chains.
    async with ShardedClient(targets, tenant="acme", timeout=5.0) as other:
        ns = await other.register_namespace("m", LAYOUT)
        hits = [await other.lookup(ns, hashes=ns.hash(prompt(i))) for i in range(PROMPTS)]
        assert all(h.hit_blocks == 3 for h in hits)
        alone = Client(targets[0], tenant="acme", timeout=5.0)  # one node alone has its share
        async with alone:
            part = await alone.register_namespace("m", LAYOUT)
            found = [(await alone.lookup(part, prompt(i))).hit_blocks for i in range(PROMPTS)]
        assert found.count(3) == per_node[0] // 3 and set(found) == {0, 3}


async def test_nodes_with_different_salts_and_bad_lists_are_refused(server_config):
    other = dataclasses.replace(
        server_config, pool_prefix=f"{server_config.pool_prefix}x", salt_secret=bytes(32)
    )
    a = Server(server_config, clock=ManualClock(), expiry_tick=0.02)
    b = Server(other, clock=ManualClock(), expiry_tick=0.02)
    await a.start()
    await b.start()
    try:
        async with ShardedClient([a.address, b.address], tenant="acme", timeout=5.0) as kv:
            with pytest.raises(FailedPrecondition, match="salt_secret"):
                await kv.register_namespace("m", LAYOUT)
    finally:
        await a.stop(0.1)
        await b.stop(0.1)
    with pytest.raises(InvalidArgument, match="twice"):
        ShardedClient([a.address, a.address])
    with pytest.raises(InvalidArgument):
        ShardedClient(a.address)  # a string, not a list


async def test_a_hit_is_released_only_through_its_own_node(nodes):
    async with ShardedClient([n.address for n in nodes], tenant="acme", timeout=5.0) as kv:
        ns = await kv.register_namespace("m", LAYOUT)
        await kv.store(ns, prompt(0), blocks(0))
        hit = await kv.lookup(ns, prompt(0), pin=True)
        async with Client(nodes[0].address, tenant="acme", timeout=5.0) as stranger:
            strange = await stranger.register_namespace("m", LAYOUT)
            foreign = await stranger.lookup(strange, prompt(0), pin=True)
            with pytest.raises(InvalidArgument, match="not looked up through"):
                await kv.release(foreign)
            await stranger.release(foreign)
        assert await kv.release(hit) == 3
        assert len(await kv.read_blocks(await kv.lookup(ns, prompt(0), pin=True))) == 3
