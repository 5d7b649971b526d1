"""Nodes on a live Redis Cluster: three masters, the namespaces' keys spread over their slots.

`tests/redis/test_keys.py` checks the slot mapping on paper; here the same
code runs against ``redis-server --cluster-enabled yes`` (three masters made
into one cluster by ``redis-cli --cluster create``) through redis-py's
asyncio ``RedisCluster``: the registry, the directory, Locate, peer fetch
and the cluster event stream across slots, then one master killed (the
documented degraded mode, docs/cluster.md "Redis Cluster") and restarted.
"""

from __future__ import annotations

import logging

import pytest
import redis.exceptions

from kvstore.v1 import kvstore_pb2 as pb
from service.cluster.directory import Directory
from service.cluster.keys import Keys
from service.cluster.registry import Registry
from tests.redis.rpc import Rpc, block_bytes
from tests.redis.server import REDIS_SERVER
from tests.waiting import until

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server on PATH")

KEYS = Keys("kvt")
MODELS = [f"model-{i}" for i in range(8)]


async def _live_ids(rc) -> list[str]:
    return [n.node_id for n in await Registry(KEYS, 1000, 1000).live_nodes(rc)]


async def _held(rc, node_id: str, ns: str, scope: str, chain: list[bytes]) -> int:
    holders = await Directory(KEYS, "observer", 1000).locate(rc, ns, scope, chain)
    return next((h.blocks for h in holders if h.node_id == node_id), 0)


async def _register_all(address: str) -> dict[str, Rpc]:
    """One Rpc per model on the node at ``address`` (tenant acme), registered."""
    rpcs = {}
    for model in MODELS:
        rpc = Rpc(address, "acme")
        await rpc.register(model)
        rpcs[model] = rpc
    return rpcs


async def test_registry_directory_locate_fetch_and_events_across_slots(redis_cluster, cnodes, rc):
    a = await cnodes.start("node-a")
    b = await cnodes.start("node-b")
    await until(lambda: _equals(_live_ids(rc), ["node-a", "node-b"]), what="both nodes live")
    on_a, on_b = await _register_all(a.address), await _register_all(b.address)
    try:
        masters = {redis_cluster.master_of(KEYS.ns_alive(r.namespace)).port for r in on_a.values()}
        assert len(masters) == 3, "the namespaces' keys must spread over every master"
        watch = on_b[MODELS[0]].stub.WatchEvents(pb.WatchEventsRequest(cluster=True), timeout=30)
        await watch.initial_metadata()
        chains = {}
        for seed, model in enumerate(MODELS, start=1):
            chains[model] = await on_a[model].store(seed=seed, blocks=3)
        for seed, model in enumerate(MODELS, start=1):
            ns = on_a[model].namespace
            await until(
                lambda ns=ns, m=model: _equals(_held(rc, "node-a", ns, "acme", chains[m]), 3),
                what=f"{model} in the directory",
            )
            hit = await on_b[model].lookup(seed, 3, remote=True)
            assert hit.hit_blocks == 3
            assert await on_b[model].read(seed, 3) == [block_bytes(seed, i) for i in range(3)]
        assert b.node.peers.fetched_blocks == 3 * len(MODELS)
        # Every namespace's STORED event from node-a reaches node-b's cluster watch.
        pending = {r.namespace for r in on_a.values()}
        async for event in watch:
            if event.kind == pb.EVENT_KIND_STORED and event.node_id == "node-a":
                pending.discard(event.namespace_id)
                if not pending:
                    break
        watch.cancel()
        assert not pending
    finally:
        for rpc in [*on_a.values(), *on_b.values()]:
            await rpc.close()


async def _equals(value, expected) -> bool:
    return await value == expected


async def test_one_master_killed_degrades_to_local_then_recovers(redis_cluster, cnodes, rc, caplog):
    a = await cnodes.start("node-a")
    b = await cnodes.start("node-b")
    on_a, on_b = await _register_all(a.address), await _register_all(b.address)
    try:
        registry_master = redis_cluster.master_of(KEYS.nodes)
        # A namespace whose keys live on another master than the registry's: the victim.
        doomed = next(
            m for m in MODELS
            if redis_cluster.master_of(KEYS.ns_alive(on_a[m].namespace)) is not registry_master
        )  # fmt: skip
        safe = next(
            m for m in MODELS
            if redis_cluster.master_of(KEYS.ns_alive(on_a[m].namespace)) is registry_master
        )  # fmt: skip
        victim = redis_cluster.master_of(KEYS.ns_alive(on_a[doomed].namespace))
        doomed_chain = await on_a[doomed].store(seed=1, blocks=3)
        await on_a[safe].store(seed=2, blocks=3)
        # Fetched to b while the cluster is whole: then local on b.
        await until(lambda: _hit(on_b[safe].lookup(2, 3, remote=True)), what="fetch of safe")
        assert (await on_b[safe].lookup(2, 3)).hit_blocks == 3
        await until(
            lambda: _equals(_held(rc, "node-a", on_a[doomed].namespace, "acme", doomed_chain), 3),
            what="the doomed namespace in the directory",
        )

        victim.kill()
        # Both nodes need the victim's slots (both serve the doomed namespace):
        # each counts Redis as down, logs it, and serves its local cache only.
        for server in (a, b):
            await until(lambda s=server: not s.node.cluster.connected, what="Redis counted down")
            metric = server.node.metrics.registry.get_sample_value("kvstore_redis_connected")
            assert metric == 0
        assert any(
            r.levelno == logging.WARNING and "Redis unavailable" in r.getMessage()
            for r in caplog.records
        )
        assert (await on_b[safe].lookup(2, 3)).hit_blocks == 3
        assert (await on_a[doomed].lookup(1, 3)).hit_blocks == 3
        # A remote lookup is answered locally (a miss), not an error.
        assert (await on_b[doomed].lookup(1, 3, remote=True)).hit_blocks == 0
        # The killed master's slots fail; the other masters' keys still answer:
        # the registry shows both nodes, silent, leaving within their TTL.
        await until(lambda: _equals(_live_ids(rc), []), what="silent nodes leave the registry")
        with pytest.raises(redis.exceptions.RedisError):
            await Directory(KEYS, "observer", 1000).locate(
                rc, on_a[doomed].namespace, "acme", doomed_chain
            )

        victim.start()  # same port and nodes.conf: it rejoins, empty
        for server in redis_cluster.servers:
            await until(lambda s=server: redis_cluster.state_ok(s), what="cluster_state:ok")
        for server in (a, b):
            await until(lambda s=server: s.node.cluster.connected, what="Redis reconnected")
        await until(lambda: _equals(_live_ids(rc), ["node-a", "node-b"]), what="rejoined")
        # The resync rewrote node-a's entries on the restarted master.
        hit = await until(
            lambda: _hit(on_b[doomed].lookup(1, 3, remote=True)), what="peer fetch after recovery"
        )
        assert hit == 3
        assert await on_b[doomed].read(1, 3) == [block_bytes(1, i) for i in range(3)]
    finally:
        for rpc in [*on_a.values(), *on_b.values()]:
            await rpc.close()


async def _hit(lookup) -> int:
    return (await lookup).hit_blocks
