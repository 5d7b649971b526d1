"""Peer fetch over the gRPC stream checks each block's checksum where it landed.

The holder's bytes are changed after commit through a runner's mapping of its
pool (a flipped bit, another block's bytes): the reader commits the blocks
before the bad one, aborts it and the rest of the chain (a miss), counts
``kvstore_checksum_failures_total{tier="peer"}`` and logs the block, the tier
and the holder.
"""

from __future__ import annotations

import logging

import pytest

from kvstore.client import Client
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from tests.redis.rpc import MODEL, Rpc, block_bytes, prompt
from tests.replies import blocks_of
from tests.waiting import until

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float16")
"""The layout of `tests.redis.rpc` (256-byte blocks), as the SDK names it."""


async def spoil(address: str, seed: int, blocks: int, change) -> None:
    """Change the bytes of a stored prompt's blocks in the holder's pool (``change(buffers)``)."""
    async with Client(address, tenant="acme", timeout=5.0) as kv:
        ns = await kv.register_namespace(MODEL, LAYOUT)
        hit = await kv.lookup(ns, prompt(seed, blocks), pin=True)
        assert hit.hit_blocks == blocks
        change(hit.buffers())
        await kv.release(hit)


def failures(server, namespace: str) -> float:
    value = server.node.metrics.registry.get_sample_value(
        "kvstore_checksum_failures_total", {"namespace": namespace, "tier": "peer"}
    )
    return value or 0.0


async def two_nodes_with(nodes, seed: int, blocks: int):
    # The gRPC stream (NIXL has its own test: tests/redis/test_peer_nixl.py).
    a = await nodes.start("node-a", peer_transport="grpc")
    b = await nodes.start("node-b", peer_transport="grpc")
    ra, rb = Rpc(a.address, "acme"), Rpc(b.address, "acme")
    await ra.register()
    await rb.register()
    chain = await ra.store(seed=seed, blocks=blocks)
    await until(lambda: b.node.cluster.locate(ra.namespace, "acme", chain), what="entry")
    return a, b, ra, rb, chain


async def test_intact_blocks_arrive_with_the_holders_checksums(nodes) -> None:
    _a, b, ra, rb, _chain = await two_nodes_with(nodes, seed=3, blocks=4)
    try:
        hit = await rb.lookup(3, 4, remote=True)
        assert hit.hit_blocks == 4
        held = await ra.lookup(3, 4)
        assert [x.checksum for x in blocks_of(hit)] == [x.checksum for x in blocks_of(held)]
        assert all(x.checksum for x in blocks_of(hit))
        assert failures(b, rb.namespace) == 0
    finally:
        await ra.close()
        await rb.close()


async def test_a_flipped_bit_at_the_holder_is_a_miss_a_metric_and_a_log(
    nodes, caplog: pytest.LogCaptureFixture
) -> None:
    a, b, ra, rb, chain = await two_nodes_with(nodes, seed=5, blocks=5)
    try:

        def flip(buffers) -> None:
            buffers[2][100] ^= 0x04

        await spoil(a.address, 5, 5, flip)
        with caplog.at_level(logging.WARNING, logger="service.node"):
            hit = await rb.lookup(5, 5, remote=True)
        # Blocks 0 and 1 were good and are kept; 2 and everything after it are not.
        assert hit.hit_blocks == 2
        assert await rb.read(5, 2) == [block_bytes(5, i) for i in range(2)]
        assert failures(b, rb.namespace) == 1
        lines = [r.getMessage() for r in caplog.records if "checksum mismatch" in r.getMessage()]
        assert len(lines) == 1
        assert chain[2].hex()[:16] in lines[0]
        assert "tier peer" in lines[0] and "node-a" in lines[0]
        # Nothing of the aborted blocks stays reserved on the reader.
        stats = await rb.stub.Stats(pb.StatsRequest(), timeout=5)
        assert stats.writing == 0
    finally:
        await ra.close()
        await rb.close()


async def test_a_holder_that_sends_another_blocks_bytes_is_refused(nodes) -> None:
    a, b, ra, rb, _chain = await two_nodes_with(nodes, seed=6, blocks=4)
    try:

        def misplace(buffers) -> None:
            buffers[0][:] = buffers[3]  # block 0's slot now holds block 3's bytes

        await spoil(a.address, 6, 4, misplace)
        hit = await rb.lookup(6, 4, remote=True)
        assert hit.hit_blocks == 0
        assert failures(b, rb.namespace) == 1
        assert (await rb.lookup(6, 4)).hit_blocks == 0  # nothing was committed
    finally:
        await ra.close()
        await rb.close()
