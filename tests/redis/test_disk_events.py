"""The disk tier's blocks on the cluster event stream (docs/disk.md, "In the cluster").

Node a has a disk tier; its committed blocks are written through to disk, and
each write that completes is an entry with ``tier`` = ``disk`` on ``{P}:events``,
read back by a watcher on node b (``WatchEvents(cluster=true)``) with tier
"disk". The pool's entries stay as they were: no ``tier`` field.
"""

from __future__ import annotations

import asyncio

import grpc

from kvstore.v1 import kvstore_pb2 as pb
from service.cluster.keys import Keys
from tests.redis.rpc import Rpc
from tests.redis.test_disk_cluster import disk
from tests.waiting import until

KEYS = Keys("kvt")
BLOCKS = 4


def entry_hashes(entries, kind: bytes, tier: bytes | None) -> set[bytes]:
    """Hashes of node a's stream entries of ``kind`` and ``tier`` (None: no tier field)."""
    out: set[bytes] = set()
    for _, f in entries:
        if f[b"kind"] == kind and f[b"node"] == b"node-a" and f.get(b"tier") == tier:
            raw = f[b"hashes"]
            out.update(raw[i : i + 32] for i in range(0, len(raw), 32))
    return out


def event_hashes(events: list[pb.Event], kind: pb.EventKind.ValueType, tier: str) -> set[bytes]:
    return {h for e in events if e.kind == kind and e.tier == tier for h in e.hashes}


async def read_until(
    watch: grpc.aio.UnaryStreamCall[pb.WatchEventsRequest, pb.Event], got: list[pb.Event], done
) -> None:
    async with asyncio.timeout(10):
        while not done():
            event = await watch.read()
            assert isinstance(event, pb.Event), "the watch ended"
            got.append(event)


async def test_disk_blocks_reach_the_stream_and_cluster_watchers(nodes, rclient, tmp_path):
    a = await nodes.start("node-a", **disk(tmp_path))
    b = await nodes.start("node-b")
    ra, rb = Rpc(a.address), Rpc(b.address)
    try:
        await b.node.cluster.wait_synced()
        watch = rb.stub.WatchEvents(pb.WatchEventsRequest(cluster=True), timeout=30)
        await watch.initial_metadata()  # reading from the stream's newest entry on
        ns = await ra.register()
        chain = set(await ra.store(seed=7, blocks=BLOCKS))

        async def xrange():
            return await rclient.xrange(KEYS.events)

        entries = await until(
            xrange, ok=lambda e: entry_hashes(e, b"stored", b"disk") == chain, what="disk entries"
        )
        assert entry_hashes(entries, b"stored", None) == chain  # the pool's: no tier field
        assert {f.get(b"tier") for _, f in entries} == {None, b"disk"}
        on_disk = next(f for _, f in entries if f.get(b"tier") == b"disk")
        assert on_disk[b"ns"] == ns.encode() and on_disk[b"tenant"] == b"default"
        assert float(on_disk[b"at"]) > 1e9  # unix seconds

        got: list[pb.Event] = []
        stored = pb.EVENT_KIND_STORED
        await read_until(watch, got, lambda: event_hashes(got, stored, "disk") == chain)
        assert event_hashes(got, stored, "memory") == chain
        assert {e.node_id for e in got if e.hashes} == {"node-a"}

        # Evicted from the pool: a memory entry; the disk still holds the blocks.
        await ra.stub.Evict(pb.EvictRequest(namespace_id=ns, blocks=BLOCKS), timeout=5)
        await until(
            xrange, ok=lambda e: entry_hashes(e, b"removed", None) == chain, what="pool removal"
        )
        # Dropped: the disk tier forgets them, an entry with tier disk.
        await ra.stub.DropNamespace(
            pb.DropNamespaceRequest(namespace_id=ns, force=True), metadata=ra.md, timeout=10
        )
        await until(
            xrange, ok=lambda e: entry_hashes(e, b"removed", b"disk") == chain, what="disk removal"
        )
        removed = pb.EVENT_KIND_REMOVED
        await read_until(watch, got, lambda: event_hashes(got, removed, "disk") == chain)
        assert event_hashes(got, removed, "memory") == chain
        watch.cancel()
        assert a.node.cluster is not None and a.node.cluster.events_dropped == 0
    finally:
        await ra.close()
        await rb.close()
