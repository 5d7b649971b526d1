"""Two and three in-process nodes on a private Redis: registry, directory, peer fetch, events."""

from __future__ import annotations

import asyncio
import time

from kvstore.v1 import kvstore_pb2 as pb
from service.cluster.directory import Directory
from service.cluster.keys import Keys, member
from service.cluster.registry import NodeInfo, Registry
from tests.redis.rpc import Rpc, block_bytes
from tests.waiting import until

KEYS = Keys("kvt")


async def live_ids(rclient) -> list[str]:
    return [n.node_id for n in await Registry(KEYS, 1000, 1000).live_nodes(rclient)]


async def test_registry_lists_live_nodes_and_forgets_a_graceful_leaver(nodes, rclient):
    a = await nodes.start("node-a")
    b = await nodes.start("node-b")
    await until(lambda: live_ids(rclient), what="registry")
    assert await until(lambda: asyncio.ensure_future(_eq(live_ids(rclient), ["node-a", "node-b"])))
    infos = {n.node_id: n for n in await Registry(KEYS, 1000, 1000).live_nodes(rclient)}
    assert infos["node-a"].address == a.address
    assert infos["node-b"].capacity_bytes == b.node.pools.capacity_bytes
    assert infos["node-a"].version
    await nodes.stop(b)
    assert await live_ids(rclient) == ["node-a"]


async def _eq(value, expected) -> bool:
    return await value == expected


async def test_a_silent_node_expires_within_its_ttl(rclient):
    registry = Registry(KEYS, ttl_ms=300, stream_maxlen=100)
    joined, _ = await registry.heartbeat(rclient, NodeInfo("ghost", "127.0.0.1:1"))
    assert joined
    assert "ghost" in await live_ids(rclient)
    started = time.monotonic()
    await until(lambda: _absent(rclient, "ghost"), within=3, what="ghost to expire")
    assert time.monotonic() - started < 1.0
    # The next heartbeat of anyone reaps it and says so on the stream, once.
    await registry.heartbeat(rclient, NodeInfo("other", "127.0.0.1:2"))
    entries = await rclient.xrange(KEYS.events)
    kinds = [(f[b"kind"], f[b"node"]) for _, f in entries]
    assert kinds.count((b"node_left", b"ghost")) == 1
    assert (b"node_joined", b"ghost") in kinds


async def _absent(rclient, node_id: str) -> bool:
    return node_id not in await live_ids(rclient)


async def test_directory_publish_evict_clear_and_locate(nodes, rclient):
    a = await nodes.start("node-a")
    b = await nodes.start("node-b")
    ra, rb = Rpc(a.address), Rpc(b.address)
    try:
        ns = await ra.register()
        await rb.register()
        chain = await ra.store(seed=1, blocks=6)
        directory = Directory(KEYS, "observer", 1000)
        scope = a.node.table(ns).scope_of("default")

        async def held_by_a() -> int:
            holders = await directory.locate(rclient, ns, scope, chain)
            return next((h.blocks for h in holders if h.node_id == "node-a"), 0)

        await until(lambda: _is(held_by_a(), 6), what="6 blocks in the directory")
        holders = await directory.locate(rclient, ns, scope, chain)
        assert [(h.node_id, h.address) for h in holders] == [("node-a", a.address)]
        # Another tenant's scope never matches: members carry the scope.
        assert await directory.locate(rclient, ns, "someone-else", chain) == []
        # Evict the two least recently used (leaves last): the prefix shrinks.
        evicted = await ra.stub.Evict(pb.EvictRequest(namespace_id=ns, blocks=2), timeout=5)
        assert evicted.evicted == 2
        await until(lambda: _is(held_by_a(), 4), what="eviction in the directory")
        await ra.stub.Clear(pb.ClearRequest(namespace_id=ns), timeout=5)
        await until(lambda: _is(held_by_a(), 0), what="clear in the directory")
    finally:
        await ra.close()
        await rb.close()


async def test_a_new_namespace_is_locatable_as_soon_as_its_blocks_are_listed(nodes, rclient):
    # A heartbeat far away: the liveness of a namespace registered after it
    # must not wait for the next one (peers would find its blocks held by nobody).
    a = await nodes.start("node-a", heartbeat_seconds=30.0, node_ttl_seconds=60.0)
    await a.node.cluster.wait_synced()
    ra = Rpc(a.address)
    try:
        ns = await ra.register()
        chain = await ra.store(seed=2, blocks=3)
        scope = a.node.table(ns).scope_of("default")
        listed = KEYS.ns_node(ns, "node-a")
        await until(
            lambda: rclient.sismember(listed, member(chain[-1], scope)), what="blocks listed"
        )
        holders = await Directory(KEYS, "observer", 1000).locate(rclient, ns, scope, chain)
        assert [(h.node_id, h.blocks) for h in holders] == [("node-a", 3)]
    finally:
        await ra.close()


async def _is(value, expected) -> bool:
    return await value == expected


async def test_peer_fetch_is_byte_exact_and_per_tenant(nodes):
    a = await nodes.start("node-a")
    b = await nodes.start("node-b")
    c = await nodes.start("node-c")
    ra, rb, rc = Rpc(a.address, "acme"), Rpc(b.address, "acme"), Rpc(c.address, "acme")
    other = Rpc(b.address, "globex")
    try:
        for r in (ra, rb, rc, other):
            await r.register()
        chain = await ra.store(seed=7, blocks=5)
        await until(lambda: b.node.cluster.locate(ra.namespace, "acme", chain), what="entry")
        # Not remote: a miss. Remote: fetched from node-a, committed, served.
        assert (await rb.lookup(7, 5)).hit_blocks == 0
        hit = await rb.lookup(7, 5, remote=True)
        assert hit.hit_blocks == 5
        assert await rb.read(7, 5) == [block_bytes(7, i) for i in range(5)]
        assert b.node.peers.fetched_blocks == 5
        metrics = b.node.metrics.registry
        assert metrics.get_sample_value("kvstore_peer_fetched_blocks_total") == 5
        assert metrics.get_sample_value("kvstore_redis_connected") == 1
        # Another tenant asking for the same tokens gets nothing from anyone.
        assert (await other.lookup(7, 5, remote=True)).hit_blocks == 0
        # node-c can now fetch from a or b; the bytes are the same.
        assert (await rc.lookup(7, 5, remote=True)).hit_blocks == 5
        assert await rc.read(7, 5) == [block_bytes(7, i) for i in range(5)]
    finally:
        for r in (ra, rb, rc, other):
            await r.close()


async def test_peer_that_vanished_is_a_miss_not_an_error(nodes):
    a = await nodes.start("node-a", node_ttl_seconds=5.0)
    b = await nodes.start("node-b")
    ra, rb, other = Rpc(a.address), Rpc(b.address), Rpc(b.address, "other")
    try:
        await ra.register()
        await rb.register()
        await other.register()
        chain = await ra.store(seed=3, blocks=4)
        await until(lambda: b.node.cluster.locate(ra.namespace, "default", chain), what="entry")
        # Another tenant fills node-b's namespace.
        table = b.node.table(rb.namespace)
        await other.store(seed=9, blocks=table.capacity)
        # Stop a's gRPC without leaving the registry: the directory still names it.
        await a._grpc.stop(0)
        hit = await rb.lookup(3, 4, remote=True)
        assert hit.hit_blocks == 0
        # Contact first, then make room: the dead holder cost the other tenant nothing.
        assert table.stats().evictions == 0
        assert b.node.peers.failed_fetches >= 1
        failed = b.node.metrics.registry.get_sample_value("kvstore_peer_failed_fetches_total")
        assert failed is not None and failed >= 1
    finally:
        await ra.close()
        await rb.close()
        await other.close()


async def test_cluster_watch_sees_every_nodes_events(nodes):
    a = await nodes.start("node-a")
    b = await nodes.start("node-b")
    ra, rb = Rpc(a.address), Rpc(b.address)
    try:
        await ra.register()
        await rb.register()
        call = rb.stub.WatchEvents(pb.WatchEventsRequest(cluster=True), timeout=20)
        await call.initial_metadata()
        chain = await ra.store(seed=5, blocks=3)
        got = []
        async for event in call:
            got.append(event)
            if event.kind == pb.EVENT_KIND_STORED and event.node_id == "node-a":
                break
        assert list(got[-1].hashes) == chain
        assert got[-1].namespace_id == ra.namespace
        call.cancel()
    finally:
        await ra.close()
        await rb.close()


async def test_a_peers_fetch_leaves_no_trace_in_the_holders_stats_or_lru(nodes):
    a = await nodes.start("node-a")
    b = await nodes.start("node-b")
    ra, rb = Rpc(a.address, "acme"), Rpc(b.address, "acme")
    try:
        ns = await ra.register()
        await rb.register()
        chain = await ra.store(seed=11, blocks=4)  # older: first in a's LRU
        await ra.store(seed=12, blocks=2)
        table = a.node.table(ns)
        lru_before = table.lru_order()
        counters_before = table.stats().tenants.get("acme")
        hits_before = {i.hash: i.hits for i in table.iter_blocks()}
        await until(lambda: b.node.cluster.locate(ns, "acme", chain), what="entry")
        assert (await rb.lookup(11, 4, remote=True)).hit_blocks == 4
        # node-a served the blocks, yet its tenant did not use its cache.
        assert table.lru_order() == lru_before
        assert table.stats().tenants.get("acme") == counters_before
        assert {i.hash: i.hits for i in table.iter_blocks()} == hits_before
    finally:
        await ra.close()
        await rb.close()
