"""The disk tier seen by the cluster: the directory's disk set, the prefix query's "disk"
holder, KV events with the disk medium, and a peer fetch served from a node's disk.

Node a stores a prompt (written through to its disk), then restarts on the same
tier file: its memory is empty, its disk holds the prompt, and only the disk
(format 2: full hashes and scope names in the slot headers) can name the blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from kvstore.v1 import kvstore_pb2 as pb
from service.cluster.keys import Keys, member
from service.vllm_events import wire
from service.vllm_events.subscriber import zmq_modules
from tests.inproc import BLOCK_SIZE
from tests.redis.rpc import Rpc, block_bytes, prompt
from tests.redis.test_query_prefix import holders
from tests.waiting import until

KEYS = Keys("kvt")
BLOCKS = 6


def disk(tmp_path, **more: Any) -> dict[str, Any]:
    return {
        "disk_path": str(tmp_path / "a.disk"),
        "disk_capacity_bytes": 80 << 20,
        "directory_flush_seconds": 0.01,
        **more,
    }


async def disk_members(rclient, ns: str, node: str) -> set[bytes]:
    return set(await rclient.smembers(KEYS.ns_disk(ns, node)))


async def store_then_restart(nodes, rclient, tmp_path, **more: Any):
    """Node a stores prompt 1 (on its disk once written), stops, starts again empty."""
    a = await nodes.start("node-a", **disk(tmp_path, **more))
    ra = Rpc(a.address)
    ns = await ra.register()
    chain = await ra.store(seed=1, blocks=BLOCKS)
    want = {member(h, "default") for h in chain}

    async def on_disk() -> bool:
        return await disk_members(rclient, ns, "node-a") == want

    await until(on_disk, what="node a's disk set in the directory")
    await ra.close()
    await nodes.stop(a)
    a = await nodes.start("node-a", **disk(tmp_path, **more))
    ra = Rpc(a.address)
    await ra.register()
    return a, ra, ns, chain, want


@contextlib.asynccontextmanager
async def restarted(nodes, client, tmp_path) -> AsyncIterator[tuple[Any, ...]]:
    """Node a restarted with prompt 1 on its disk only, and node b, both registered."""
    a, ra, ns, chain, want = await store_then_restart(nodes, client, tmp_path)
    b = await nodes.start("node-b")
    rb = Rpc(b.address)
    try:
        await rb.register()
        yield a, rb, ns, chain, want
    finally:
        await ra.close()
        await rb.close()


async def _equal(got, want) -> bool:
    return await got == want


async def lists_its_disk(nodes, client, tmp_path) -> None:
    async with restarted(nodes, client, tmp_path) as (_a, rb, ns, _chain, want):
        # Registered again after the restart: its disk blocks are named again, and
        # only there (its memory is empty).
        assert await client.smembers(KEYS.ns_node(ns, "node-a")) == set()
        await until(
            lambda: _equal(disk_members(client, ns, "node-a"), want),
            what="the disk set rewritten after the restart",
        )
        request = pb.QueryPrefixRequest(model="cluster-model", token_ids=prompt(1, BLOCKS))

        async def disk_holder() -> bool:
            resp = await rb.stub.QueryPrefix(request, metadata=rb.md, timeout=5)
            held = ("node-a", "disk", "", BLOCKS, BLOCKS * BLOCK_SIZE) in holders(resp)
            return resp.source == "directory" and held

        await until(disk_holder, what="the directory's answer naming node a's disk")


async def serves_a_peer_from_disk(nodes, client, tmp_path) -> None:
    async with restarted(nodes, client, tmp_path) as (a, rb, ns, chain, want):
        await until(lambda: _equal(disk_members(client, ns, "node-a"), want), what="disk set")
        assert a.node.store.lookup(ns, "default", chain, a.node.now(), peek=True).hit_blocks == 0

        async def fetched() -> bool:  # b's agent may still be connecting (a Redis Cluster)
            hit = await rb.lookup(seed=1, blocks=BLOCKS, remote=True)
            return hit.hit_blocks == BLOCKS  # fetched from a, which read them from its disk

        await until(fetched, what="a peer fetch served from a's disk")
        want_bytes = [block_bytes(1, i) for i in range(BLOCKS)]
        assert await rb.read(seed=1, blocks=BLOCKS) == want_bytes
        assert a.node.promoter is not None and a.node.promoter.promoted_blocks == BLOCKS


async def test_a_restarted_node_lists_its_disk_in_the_directory(nodes, rclient, tmp_path):
    await lists_its_disk(nodes, rclient, tmp_path)


async def test_the_disk_holder_on_redis_cluster(cnodes, rc, tmp_path):
    await lists_its_disk(cnodes, rc, tmp_path)  # the scripts read disk sets in the ns's slot


async def test_a_peer_fetch_is_served_from_the_holders_disk(nodes, rclient, tmp_path):
    await serves_a_peer_from_disk(nodes, rclient, tmp_path)


async def test_a_peer_fetch_from_disk_on_redis_cluster(cnodes, rc, tmp_path):
    await serves_a_peer_from_disk(cnodes, rc, tmp_path)


async def test_removed_from_disk_leaves_the_disk_set(nodes, rclient, tmp_path):
    a = await nodes.start("node-a", **disk(tmp_path))
    ra = Rpc(a.address)
    try:
        ns = await ra.register()
        chain = await ra.store(seed=2, blocks=3)
        want = {member(h, "default") for h in chain}
        await until(lambda: _equal(disk_members(rclient, ns, "node-a"), want), what="stored")
        await ra.stub.DropNamespace(
            pb.DropNamespaceRequest(namespace_id=ns, force=True), metadata=ra.md, timeout=10
        )
        await until(lambda: _equal(disk_members(rclient, ns, "node-a"), set()), what="removed")
    finally:
        await ra.close()


async def test_kv_events_name_the_disk_medium(nodes, rclient, tmp_path):
    zmq, _ = zmq_modules()
    a = await nodes.start("node-a", **disk(tmp_path, kv_events_endpoint="tcp://127.0.0.1:*"))
    ra = Rpc(a.address)
    publisher = a.node.kv_events.publisher
    assert publisher is not None
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    try:
        await ra.register()
        await asyncio.sleep(0.2)  # the SUB socket joins asynchronously
        chain = await ra.store(seed=3, blocks=4)
        media: dict[str, set[bytes]] = {}
        deadline = time.monotonic() + 10
        while media.get("disk", set()) != set(chain) and time.monotonic() < deadline:
            if not sub.poll(100):
                await asyncio.sleep(0.01)
                continue
            _topic, _seq, payload = sub.recv_multipart()
            for ev in wire.decode_batch(payload).events:
                if isinstance(ev, wire.Stored):
                    media.setdefault(ev.medium or "", set()).update(ev.block_hashes)  # type: ignore[arg-type]
        assert media["disk"] == set(chain), "BlockStored with the disk medium, full hashes"
        assert media[publisher.medium] == set(chain), "and the pool's, as before"
    finally:
        sub.close(0)
        ctx.term()
        await ra.close()
