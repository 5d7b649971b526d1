"""Peer fetch over NIXL between two real node processes, and its fallbacks.

Each node is a ``python -m service`` child process (`benchmarks._server`)
on a private redis-server, so the two NIXL agents live in two processes and
the bytes cross between their pools as they would between hosts (UCX picks
shared memory here). The transport a fetch used is read from the reader's
``kvstore_peer_fetches_total{transport}`` counter, so a NIXL test cannot
pass through the gRPC fallback unnoticed.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import redis

from benchmarks._server import ServerProcess
from kvstore import KVLayout
from kvstore.client import Client
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.cluster.keys import Keys, member
from tests.redis.rpc import MODEL, Rpc, block_bytes, prompt
from tests.redis.server import REDIS_SERVER, RedisServer, free_port
from tests.waiting import until

pytest.importorskip("nixl._api", reason="needs the nixl package (pip install kvstore[nixl])")
pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server on PATH")

TOKEN = "nixl-test-token"
TENANT = "acme"


class Node:
    """A node process on the test's Redis, with its metrics endpoint."""

    def __init__(self, shm, redis_url: str, node_id: str, *extra: str) -> None:
        self.metrics_port = free_port()
        args = (
            "--redis-url", redis_url, "--node-id", node_id, "--redis-key-prefix", "kvn",
            "--metrics-port", str(self.metrics_port), "--heartbeat-seconds", "0.2",
            "--node-ttl-seconds", "2", "--directory-flush-seconds", "0.01",
            "--peer-fetch-timeout", "2", "--arena-bytes", "1MiB", "--log-level", "INFO",
        )  # fmt: skip
        self.proc = ServerProcess.start(
            shm, capacity="64MiB", extra_args=(*args, *extra), ready_timeout=60
        )
        self.address = self.proc.address
        self.node_id = node_id

    def fetches(self, transport: str) -> float:
        """This node's peer fetches over ``transport`` so far (from /metrics)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            page = resp.read().decode()
        match = re.search(
            rf'^kvstore_peer_fetches_total\{{transport="{transport}"\}} (\S+)$', page, re.M
        )
        assert match, f"no peer fetch counter for {transport} in the metrics"
        return float(match.group(1))

    def failures(self) -> float:
        """Peer blocks this node refused for their checksum, all namespaces (from /metrics)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            page = resp.read().decode()
        found = re.findall(
            r'^kvstore_checksum_failures_total\{[^}]*tier="peer"[^}]*\} (\S+)$', page, re.M
        )
        return sum(float(v) for v in found)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def shm(tmp_path_factory):
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
def holder(shm, redis_url) -> Iterator[Node]:
    node = Node(shm, redis_url, "holder", "--cluster-token", TOKEN)
    try:
        yield node
    finally:
        node.proc.stop()


@pytest.fixture(scope="module")
def reader(shm, redis_url, holder) -> Iterator[Node]:
    node = Node(shm, redis_url, "reader", "--cluster-token", TOKEN)
    try:
        yield node
    finally:
        node.proc.stop()


def digest(blocks: list[bytes]) -> str:
    return hashlib.sha256(b"".join(blocks)).hexdigest()


async def stats(address: str) -> pb.StatsResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        return await stub.Stats(pb.StatsRequest(), timeout=5)


async def nothing_held(address: str) -> bool:
    """No pins and no reservations left on the node."""
    s = await stats(address)
    return s.pinned == 0 and s.writing == 0


async def stored(
    redis_url: str, holder: Node, reader: Node, seed: int, blocks: int
) -> tuple[Rpc, Rpc, list[bytes]]:
    """Store ``blocks`` blocks on ``holder``; wait until the directory names it for them."""
    rh, rr = Rpc(holder.address, TENANT), Rpc(reader.address, TENANT)
    await rh.register()
    await rr.register()
    chain = await rh.store(seed=seed, blocks=blocks)
    key = Keys("kvn").ns_node(rh.namespace, holder.node_id)
    last = member(chain[-1], TENANT)
    with redis.Redis.from_url(redis_url, socket_timeout=2) as r:
        await until(lambda: r.sismember(key, last), what="the holder's directory entry")
    return rh, rr, chain


async def test_nixl_moves_the_right_bytes_and_unpins(redis_url, holder, reader):
    rh, rr, _ = await stored(redis_url, holder, reader, seed=1, blocks=40)
    try:
        before = reader.fetches("nixl"), reader.fetches("grpc")
        hit = await rr.lookup(1, 40, remote=True)
        assert hit.hit_blocks == 40
        assert reader.fetches("nixl") == before[0] + 1
        assert reader.fetches("grpc") == before[1]
        expected = [block_bytes(1, i) for i in range(40)]
        assert digest(await rr.read(1, 40)) == digest(expected)
        # Nothing pinned or reserved is left on either side.
        assert await nothing_held(holder.address)
        assert await nothing_held(reader.address)
    finally:
        await rh.close()
        await rr.close()


async def test_nixl_checks_checksums_where_the_bytes_landed(redis_url, holder, reader):
    """A bit flipped in the holder's pool after commit: the blocks before it are
    committed, it and the rest are a miss, and the reader counts the failure."""
    rh, rr, _ = await stored(redis_url, holder, reader, seed=9, blocks=6)
    try:
        layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float16")
        async with Client(holder.address, tenant=TENANT, timeout=5.0) as kv:
            ns = await kv.register_namespace(MODEL, layout)
            held = await kv.lookup(ns, prompt(9, 6), pin=True)
            assert held.hit_blocks == 6 and all(held.checksums.tolist())
            held.buffers()[3][7] ^= 0x80
            await kv.release(held)
        before = reader.fetches("nixl"), reader.failures()
        hit = await rr.lookup(9, 6, remote=True)
        assert hit.hit_blocks == 3
        assert reader.fetches("nixl") == before[0] + 1
        assert reader.failures() == before[1] + 1
        assert await rr.read(9, 3) == [block_bytes(9, i) for i in range(3)]
        assert await nothing_held(reader.address)
    finally:
        await rh.close()
        await rr.close()


def peer_stub(address: str) -> tuple[grpc.aio.Channel, kvstore_pb2_grpc.KVStoreStub]:
    channel = grpc.aio.insecure_channel(address)
    return channel, kvstore_pb2_grpc.KVStoreStub(channel)


def token_md(token: str = TOKEN) -> tuple[tuple[str, str], ...]:
    return (("x-kvstore-peer-token", token),)


async def test_an_offer_names_only_held_blocks_of_the_scope_and_says_what_stayed_intact(
    redis_url, holder, reader
):
    rh, rr, chain = await stored(redis_url, holder, reader, seed=2, blocks=8)
    channel, stub = peer_stub(holder.address)
    try:

        def offer(hashes, tenant=TENANT, skip=0, token=TOKEN):
            request = pb.OfferBlocksRequest(
                namespace_id=rh.namespace, tenant=tenant, hashes=hashes, skip=skip
            )
            return stub.OfferBlocks(request, metadata=token_md(token), timeout=5)

        async def end(offer_id: int) -> int:
            request = pb.EndOfferRequest(offer_id=offer_id)
            return (await stub.EndOffer(request, metadata=token_md(), timeout=5)).intact

        unknown = await offer([bytes([7]) * 32, bytes([8]) * 32])
        assert unknown.offer_id == 0 and not unknown.blocks
        other_tenant = await offer(chain, tenant="someone-else")
        assert other_tenant.offer_id == 0 and not other_tenant.blocks

        held = await offer(chain, skip=3)
        assert held.offer_id and held.agent_name and held.agent_metadata
        assert [b.hash for b in held.blocks] == chain[3:]
        assert all(b.length == len(block_bytes(2, 0)) and b.address for b in held.blocks)
        assert await nothing_held(holder.address)  # checked at the end, never pinned
        assert await end(held.offer_id) == 5
        assert await end(held.offer_id) == 0  # ended already: nothing vouched for

        # A block evicted while an offer is open is not vouched for when it ends.
        evicted = await offer(chain)
        await rh.stub.Clear(pb.ClearRequest(namespace_id=rh.namespace), timeout=5)
        assert await end(evicted.offer_id) == 0

        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await offer(chain, token="wrong")
        assert wrong.value.code() == grpc.StatusCode.PERMISSION_DENIED
        request = pb.OfferBlocksRequest(namespace_id=rh.namespace, tenant=TENANT, hashes=chain)
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.OfferBlocks(request, timeout=5)
        assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as unended:
            await stub.EndOffer(pb.EndOfferRequest(offer_id=1), timeout=5)
        assert unended.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await channel.close()
        await rh.close()
        await rr.close()


def failed_fetches(node: Node) -> float:
    url = f"http://127.0.0.1:{node.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        page = resp.read().decode()
    match = re.search(r"^kvstore_peer_failed_fetches_total (\S+)$", page, re.M)
    assert match, "no failed fetch counter in the metrics"
    return float(match.group(1))


async def test_a_holder_that_only_streams_is_read_over_grpc(shm, redis_url, reader):
    streamer = Node(
        shm, redis_url, "streamer", "--cluster-token", TOKEN, "--peer-transport", "grpc"
    )
    try:
        rs, rr, _ = await stored(redis_url, streamer, reader, seed=3, blocks=16)
        try:
            before = reader.fetches("nixl"), reader.fetches("grpc")
            hit = await rr.lookup(3, 16, remote=True)
            assert hit.hit_blocks == 16
            assert (reader.fetches("nixl"), reader.fetches("grpc")) == (before[0], before[1] + 1)
            assert await rr.read(3, 16) == [block_bytes(3, i) for i in range(16)]
            assert await nothing_held(reader.address)
        finally:
            await rs.close()
            await rr.close()
    finally:
        streamer.proc.stop()


async def test_a_peer_with_another_token_gives_nothing(shm, redis_url, reader):
    stranger = Node(shm, redis_url, "stranger", "--cluster-token", "another-token")
    try:
        rs, rr, _ = await stored(redis_url, stranger, reader, seed=4, blocks=8)
        try:
            before = failed_fetches(reader)

            async def refused() -> bool:
                hit = await rr.lookup(4, 8, remote=True)
                assert hit.hit_blocks == 0, "a peer with another token handed out blocks"
                return failed_fetches(reader) > before

            await until(refused, what="the stranger to refuse the fetch")
            assert await nothing_held(reader.address)
            assert await nothing_held(stranger.address)
        finally:
            await rs.close()
            await rr.close()
    finally:
        stranger.proc.stop()


BIG = KVLayout(num_layers=8, num_kv_heads=4, head_dim=128, block_size=16, dtype="float16")
"""256 KiB blocks: a READ of 128 of them (32 MiB) lasts long enough to be cut."""


async def test_a_holder_killed_is_a_miss_and_leaves_nothing_held(shm, redis_url, reader):
    victim = Node(shm, redis_url, "victim", "--cluster-token", TOKEN)
    try:
        rv, rr, _ = await stored(redis_url, victim, reader, seed=5, blocks=8)
        rng = np.random.default_rng(5)
        tokens = [int(t) for t in rng.integers(0, 32000, 128 * BIG.block_size)]
        data = [rng.integers(0, 256, BIG.block_bytes, np.uint8).tobytes() for _ in range(128)]
        async with (
            Client(victim.address, tenant=TENANT) as kv_victim,
            Client(reader.address, tenant=TENANT) as kv_reader,
        ):
            ns = await kv_victim.register_namespace("nixl-big", BIG)
            chain = (await kv_victim.store(ns, tokens, data)).chain
            ns_reader = await kv_reader.register_namespace("nixl-big", BIG)
            key = Keys("kvn").ns_node(ns.id, victim.node_id)
            with redis.Redis.from_url(redis_url, socket_timeout=2) as r:
                await until(lambda: r.sismember(key, member(chain[-1], TENANT)), what="entry")
            # Killed while a fetch runs (once the reader has reserved its slots, if the
            # fetch is not over by then): all of it or none of it, never wrong bytes.
            fetch = asyncio.create_task(kv_reader.lookup(ns_reader, tokens, allow_remote=True))

            async def reserved_or_done() -> bool:
                return fetch.done() or (await stats(reader.address)).writing > 0

            await until(reserved_or_done, what="the fetch to reserve its slots")
            victim.proc.process.kill()
            hit = await fetch
            assert hit.hit_blocks in (0, 128)
            if hit.hit_blocks:
                pinned = await kv_reader.lookup(ns_reader, tokens, pin=True)
                assert [bytes(b) for b in pinned.buffers()] == data
                await kv_reader.release(pinned)
            await until(lambda: nothing_held(reader.address), what="the reader to hold nothing")
        # Dead, but still in the directory (until node_ttl): a miss, nothing left held.
        assert (await rr.lookup(5, 8, remote=True)).hit_blocks == 0
        assert await nothing_held(reader.address)
        await rv.close()
        await rr.close()
    finally:
        victim.proc.stop()
