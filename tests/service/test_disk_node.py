"""The disk tier in an in-process node, on a real tier file (docs/disk.md).

Each test stores blocks through the SDK, stops the node cleanly (which
flushes the tier), and starts a new node on the same file: its memory is
empty, so every hit is a block promoted from disk.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import re
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvstore.cli.reads import disk_line
from kvstore.client import Client, Namespace, SyncClient
from kvstore.client.replies import request_fields
from kvstore.ops.summary import status_json
from kvstore.types import BlockHash, LeaseId, TenantId
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.config import Config
from service.disk import DiskKey, DiskTierError
from service.disk.io import TierFile
from service.server import Server
from tests.client.blocks import LAYOUT
from tests.conftest import started
from tests.inproc import ManualClock
from tests.kvstore.pool.fake_cuda import FakeCudaRuntime
from tests.service.cuda_node import threaded_node
from tests.waiting import until

BLOCKS = 4
TOKENS = list(range(BLOCKS * LAYOUT.block_size))


@pytest.fixture
def disk_config(server_config: Config, tmp_path: Path) -> Config:
    return replace(
        server_config,
        disk_path=str(tmp_path / "kvstore.disk"),
        disk_capacity_bytes=80 << 20,  # one 64 MiB region of the tier, and its header
    )


def random_blocks(seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, LAYOUT.block_bytes, np.uint8).tobytes() for _ in range(BLOCKS)]


async def store_and_stop(config: Config, blocks: list[bytes], tenant: str = "a") -> None:
    """Store ``blocks`` under ``tenant`` on a node that is then stopped cleanly."""
    async with (
        started(config, ManualClock()) as server,
        Client(server.address, tenant=tenant) as kv,
    ):
        ns = await kv.register_namespace("disk-model", LAYOUT)
        assert (await kv.store(ns, TOKENS, blocks)).committed == BLOCKS


def flip_a_bit_of(tier_file: Path, block: bytes) -> None:
    """Flip one bit of ``block``'s payload where it lies in the tier file."""
    image = tier_file.read_bytes()
    at = image.find(block)
    assert at > 0 and image.find(block, at + 1) == -1
    with open(tier_file, "r+b") as f:
        f.seek(at + 17)
        f.write(bytes([image[at + 17] ^ 0x01]))


def offset_in(tier_file: Path, block: bytes) -> int:
    """Where ``block``'s payload lies in the tier file."""
    at = tier_file.read_bytes().find(block)
    assert at > 0
    return at


def chain_of(ns: Namespace, tokens: list[int]) -> list[BlockHash]:
    """The chain a lookup of ``tokens`` sends (hashed here: no lookup, no promotion)."""
    packed = request_fields(ns, tokens, None, None, query_tokens=False)["packed_hashes"]
    return [BlockHash(packed[i : i + 32]) for i in range(0, len(packed), 32)]


def metric(server: Server, name: str, **labels: str) -> float:
    """One sample of the node's /metrics (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = "^" + re.escape(name + (f"{{{wanted}}}" if labels else "")) + r" (\S+)$"
    match = re.search(pattern, server.node.metrics.render().decode(), re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def test_blocks_come_back_from_disk_for_their_tenant_only(disk_config: Config) -> None:
    blocks = random_blocks(1)
    await store_and_stop(disk_config, blocks, tenant="a")
    async with (
        started(disk_config, ManualClock()) as server,
        Client(server.address, tenant="a") as a,
        Client(server.address, tenant="b") as b,
    ):
        ns_a = await a.register_namespace("disk-model", LAYOUT)
        ns_b = await b.register_namespace("disk-model", LAYOUT)
        # Before any lookup, memory is empty: the prefix query names the disk tier.
        answer = await a.query_prefix(model="disk-model", tokens=TOKENS)
        assert [(h.tier, h.matched_blocks) for h in answer.holders] == [("disk", BLOCKS)]
        chain = (await a.lookup(ns_a, TOKENS, pin=False)).packed_chain
        hashes = [chain[i : i + 32] for i in range(0, len(chain), 32)]
        # Tenant b names a's hashes: the disk keys carry the scope, nothing is promoted.
        assert (await b.lookup(ns_b, hashes=hashes)).hit_blocks == 0
        hit = await a.lookup(ns_a, TOKENS, pin=True)
        assert hit.hit_blocks == BLOCKS
        assert await a.read_blocks(hit) == blocks
        await a.release(hit)
        assert metric(server, "kvstore_disk_hits_total") == BLOCKS
        assert metric(server, "kvstore_disk_blocks") == BLOCKS
        assert metric(server, "kvstore_disk_writes_total") == 0  # promoted: not written back
        disk = status_json(await a.stats())["disk"]
        assert disk["blocks"] == BLOCKS and disk["promoted_blocks"] == BLOCKS
        assert "4 blocks" in disk_line(disk)


async def test_corrupted_bytes_on_disk_are_a_miss(disk_config: Config) -> None:
    blocks = random_blocks(2)
    await store_and_stop(disk_config, blocks)
    flip_a_bit_of(Path(disk_config.disk_path), blocks[2])  # while the node is down
    async with (
        started(disk_config, ManualClock()) as server,
        Client(server.address, tenant="a") as kv,
    ):
        ns = await kv.register_namespace("disk-model", LAYOUT)
        hit = await kv.lookup(ns, TOKENS, pin=True)
        assert hit.hit_blocks == 2  # the corrupt block and the rest of the chain: a miss
        assert await kv.read_blocks(hit) == blocks[:2]
        await kv.release(hit)
        assert metric(server, "kvstore_checksum_failures_total", namespace=ns.id, tier="disk") == 1
        assert metric(server, "kvstore_disk_blocks") == BLOCKS - 1  # discarded on disk


async def test_drop_namespace_empties_the_disk_tier(disk_config: Config) -> None:
    async with (
        started(disk_config, ManualClock()) as server,
        Client(server.address, tenant="a") as kv,
    ):
        ns = await kv.register_namespace("disk-model", LAYOUT)
        assert (await kv.store(ns, TOKENS, random_blocks(3))).committed == BLOCKS
        disk = server.node.disk
        assert disk is not None
        await until(lambda: disk.stats().blocks == BLOCKS, what="the blocks on disk")
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            await stub.DropNamespace(pb.DropNamespaceRequest(namespace_id=ns.id), timeout=5)
        assert disk.stats().blocks == 0
    async with (
        started(disk_config, ManualClock()) as server,
        Client(server.address, tenant="a") as kv,
    ):
        ns = await kv.register_namespace("disk-model", LAYOUT)  # after a restart too
        assert (await kv.lookup(ns, TOKENS)).hit_blocks == 0


async def test_a_slow_promotion_answers_what_memory_holds_then_hits(disk_config: Config) -> None:
    blocks = random_blocks(4)
    await store_and_stop(disk_config, blocks)
    config = replace(disk_config, disk_promote_timeout=1e-6)
    async with started(config, ManualClock()) as server, Client(server.address, tenant="a") as kv:
        ns = await kv.register_namespace("disk-model", LAYOUT)
        first = await kv.lookup(ns, TOKENS)
        assert first.hit_blocks < BLOCKS  # answered before the reads landed
        await until(
            lambda: server.node.promoter is not None and server.node.promoter.promoted_blocks,
            what="the promotion to finish on its own",
        )
        hit = await kv.lookup(ns, TOKENS, pin=True)
        assert hit.hit_blocks == BLOCKS
        assert await kv.read_blocks(hit) == blocks
        await kv.release(hit)
        assert metric(server, "kvstore_disk_promotion_timeouts_total") >= 1


def test_a_cuda_pool_goes_to_disk_and_comes_back(disk_config: Config) -> None:
    # No host view of a CUDA slot: copied out in a worker thread, read back
    # through host staging (docs/disk.md); the fake CUDA runtime holds the bytes.
    config = replace(disk_config, device="cuda:0", capacity_bytes=16 << 20)
    blocks = random_blocks(5)
    for attempt in ("store", "read back"):
        with (
            threaded_node(config, FakeCudaRuntime(total_bytes=1 << 25)) as server,
            SyncClient(server.address, tenant="a", map_pool=False, timeout=5.0) as kv,
        ):
            ns = kv.register_namespace("disk-model", LAYOUT)
            if attempt == "store":
                assert kv.store(ns, TOKENS, blocks).committed == BLOCKS
                continue
            hit = kv.lookup(ns, TOKENS, pin=True)
            assert hit.hit_blocks == BLOCKS
            assert kv.read_blocks(hit) == blocks
            kv.release(hit)


async def test_a_lookup_cancelled_mid_promotion_leaks_nothing(disk_config: Config) -> None:
    blocks = random_blocks(6)
    await store_and_stop(disk_config, blocks)
    async with (
        started(disk_config, ManualClock()) as server,
        Client(server.address, tenant="a") as kv,
    ):
        ns = await kv.register_namespace("disk-model", LAYOUT)
        disk = server.node.disk
        assert disk is not None
        reading, go_on = asyncio.Event(), asyncio.Event()
        real_read = disk.tier.read_many

        async def held_read(keys: list[DiskKey], dests: list[memoryview]) -> list[bool]:
            reading.set()
            await go_on.wait()
            return await real_read(keys, dests)

        disk.tier.read_many = held_read  # type: ignore[method-assign]
        lookup = asyncio.create_task(kv.lookup(ns, TOKENS, pin=True, timeout=5))
        await asyncio.wait_for(reading.wait(), 5)
        lookup.cancel()
        with pytest.raises(asyncio.CancelledError):
            await lookup
        go_on.set()  # the reads land after the caller left: the promotion still commits
        promoter = server.node.promoter
        assert promoter is not None
        await until(lambda: promoter.promoted_blocks == BLOCKS, what="the promotion to finish")
        stats = await kv.stats()
        assert (stats.pinned, stats.writing) == (0, 0)  # no pin, no slot, no lease left
        assert stats.leases == 1  # the client's own
        hit = await kv.lookup(ns, TOKENS, pin=True)
        assert hit.hit_blocks == BLOCKS and await kv.read_blocks(hit) == blocks
        await kv.release(hit)


async def test_write_behind_skips_what_it_cannot_copy_safely(disk_config: Config) -> None:
    config = replace(disk_config, disk_queue_blocks=1)
    async with (
        started(config, ManualClock()) as server,
        Client(server.address, tenant="a") as kv,
    ):
        ns = await kv.register_namespace("disk-model", LAYOUT)
        node, disk = server.node, server.node.disk
        assert disk is not None
        # Blocks committed and cleared in one step of the loop: their slots are
        # free (stamps moved) before the copies run, so nothing is written.
        chain = [BlockHash(bytes([i]) * 32) for i in range(2)]
        lease = LeaseId(12345)
        node.store.open_lease(lease, TenantId("a"), 60.0, node.now())
        node.store.reserve(ns.id, TenantId("a"), lease, chain, node.now())
        assert node.commit(ns.id, TenantId("a"), lease, chain) == 2
        node.store.clear(ns.id, node.now())
        node.publish_events()
        await until(lambda: disk.skipped["moved"] == 2, what="the copies to see the slots moved")
        # A commit of more blocks than the tier's queue waits for its room, uncopied:
        # every block is written, up to 16 x disk_queue_blocks; the rest is skipped.
        blocks, tokens = 20, list(range(1000, 1000 + 20 * LAYOUT.block_size))
        payload = [bytes([i]) * LAYOUT.block_bytes for i in range(blocks)]
        assert (await kv.store(ns, tokens, payload)).committed == blocks
        await until(lambda: disk.stats().blocks == 16, what="16 blocks on disk")
        assert metric(server, "kvstore_disk_write_drops_total", reason="backlog") == blocks - 16
        assert metric(server, "kvstore_disk_write_drops_total", reason="queue") == 0
        assert metric(server, "kvstore_disk_write_drops_total", reason="moved") == 2


async def test_a_second_node_on_the_same_disk_file_stops_at_start(disk_config: Config) -> None:
    async with started(disk_config, ManualClock()):
        with pytest.raises(DiskTierError, match="another kvstore-server uses this file"):
            Server(disk_config)
    async with started(disk_config, ManualClock()):  # free again once the first stopped
        pass


async def events_until(
    watch: grpc.aio.UnaryStreamCall[pb.WatchEventsRequest, pb.Event],
    done: Callable[[list[pb.Event]], bool],
) -> list[pb.Event]:
    """Events read from ``watch`` until ``done(all read so far)`` (10 s at most)."""
    got: list[pb.Event] = []
    async with asyncio.timeout(10):
        while not done(got):
            event = await watch.read()
            assert isinstance(event, pb.Event), "the watch ended"
            got.append(event)
    return got


def hashes_of(events: list[pb.Event], kind: pb.EventKind.ValueType, tier: str) -> set[bytes]:
    return {h for e in events if e.kind == kind and e.tier == tier for h in e.hashes}


async def test_watchers_see_the_disk_tiers_blocks_with_tier_disk(disk_config: Config) -> None:
    async with (
        started(disk_config, ManualClock()) as server,
        Client(server.address, tenant="a") as kv,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        watch = stub.WatchEvents(pb.WatchEventsRequest(), timeout=30)  # no filter: both tiers
        await watch.initial_metadata()
        ns = await kv.register_namespace("disk-model", LAYOUT)
        assert (await kv.store(ns, TOKENS, random_blocks(4))).committed == BLOCKS
        stored, disk = pb.EVENT_KIND_STORED, "disk"
        got = await events_until(watch, lambda g: len(hashes_of(g, stored, disk)) == BLOCKS)
        chain = hashes_of(got, stored, "memory")
        assert len(chain) == BLOCKS and hashes_of(got, stored, disk) == chain
        assert {e.tier for e in got} == {"memory", "disk"}
        assert all(e.node_id == "test-node" and e.namespace_id == ns.id for e in got)
        on_disk = next(e for e in got if e.tier == disk)
        assert on_disk.parent == b"" and on_disk.at > 0  # the tier writes in any order

        await stub.DropNamespace(pb.DropNamespaceRequest(namespace_id=ns.id), timeout=5)
        removed = pb.EVENT_KIND_REMOVED
        got = await events_until(watch, lambda g: hashes_of(g, removed, disk) == chain)
        assert hashes_of(got, removed, "memory") == chain  # the pool's, as before
        watch.cancel()


async def test_a_slot_reused_during_its_copy_is_not_written(disk_config: Config) -> None:
    async with (
        started(disk_config, ManualClock()) as server,
        Client(server.address, tenant="a") as kv,
    ):
        ns = await kv.register_namespace("disk-model", LAYOUT)
        node, disk = server.node, server.node.disk
        assert disk is not None
        # The copying thread is held busy: the copies wait behind it, their stamps
        # checked once (before) and their slots reserved on the tier.
        gate = threading.Event()
        disk._thread = concurrent.futures.ThreadPoolExecutor(1, "test-disk-copy")
        disk._thread.submit(gate.wait, 10)
        chain = [BlockHash(bytes([i]) * 32) for i in range(2)]
        lease = LeaseId(12345)
        node.store.open_lease(lease, TenantId("a"), 60.0, node.now())
        node.store.reserve(ns.id, TenantId("a"), lease, chain, node.now())
        assert node.commit(ns.id, TenantId("a"), lease, chain) == 2
        node.publish_events()
        await until(lambda: disk.stats().queue_depth == 2, what="the copies to be under way")
        node.store.clear(ns.id, node.now())  # the slots are freed mid-copy
        gate.set()
        await until(lambda: disk.skipped["moved"] == 2, what="the copies to see the slots moved")
        assert await disk.tier.flush(5)
        stats = disk.stats()
        assert (stats.blocks, stats.writes, stats.queue_depth) == (0, 0, 0)
        # The next commit is copied and written as ever.
        tokens = list(range(2000, 2000 + 2 * LAYOUT.block_size))
        payload = [bytes([7 + i]) * LAYOUT.block_bytes for i in range(2)]
        assert (await kv.store(ns, tokens, payload)).committed == 2
        await until(lambda: disk.stats().blocks == 2, what="2 blocks on disk")


async def test_concurrent_promotions_blame_only_their_own_corrupt_blocks(
    disk_config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40, item 6: a promotion decided "corrupt" by comparing the tier-wide
    counters before and after its read, while others ran beside it. Chain A has a
    flipped bit; chain B's read fails (EIO) while A's is counted: B was blamed for a
    checksum failure it never had. Each now goes by its own block's verdict."""
    a_blocks, b_blocks = random_blocks(7), random_blocks(8)
    b_tokens = [t + 10_000 for t in TOKENS]
    async with (
        started(disk_config, ManualClock()) as server,
        Client(server.address, tenant="a") as kv,
    ):
        ns = await kv.register_namespace("disk-model", LAYOUT)
        assert (await kv.store(ns, TOKENS, a_blocks)).committed == BLOCKS
        assert (await kv.store(ns, b_tokens, b_blocks)).committed == BLOCKS
    tier_file = Path(disk_config.disk_path)
    flip_a_bit_of(tier_file, a_blocks[2])
    b_at = offset_in(tier_file, b_blocks[1])
    real_read_into = TierFile.read_into

    def failing_read_into(self: TierFile, buffers: list[Any], offset: int) -> int:
        end = offset + sum(memoryview(b).nbytes for b in buffers)
        if offset <= b_at < end:
            raise OSError(errno.EIO, "the disk is gone")
        return real_read_into(self, buffers, offset)

    monkeypatch.setattr(TierFile, "read_into", failing_read_into)
    async with (
        started(disk_config, ManualClock()) as server,
        Client(server.address, tenant="a") as kv,
    ):
        ns = await kv.register_namespace("disk-model", LAYOUT)
        disk = server.node.disk
        assert disk is not None
        b_started, a_done = asyncio.Event(), asyncio.Event()
        real_read = disk.tier.read_many

        async def ordered(keys: list[DiskKey], dests: list[memoryview]) -> list[Any]:
            # Both promotions under way, then A's corrupt block is counted, then
            # B's read fails: the order the report's concurrent lookups hit.
            if keys[0].block_hash == a_first[0]:
                await b_started.wait()
                try:
                    return await real_read(keys, dests)
                finally:
                    a_done.set()
            b_started.set()
            await a_done.wait()
            return await real_read(keys, dests)

        a_first = chain_of(ns, TOKENS)
        disk.tier.read_many = ordered  # type: ignore[method-assign]
        a_hit, b_hit = await asyncio.gather(kv.lookup(ns, TOKENS), kv.lookup(ns, b_tokens))
        assert (a_hit.hit_blocks, b_hit.hit_blocks) == (2, 1)
        assert metric(server, "kvstore_checksum_failures_total", namespace=ns.id, tier="disk") == 1
        assert server.node.promoter is not None and server.node.promoter.checksum_failures == 1


async def test_a_promotion_past_its_timeout_says_so(disk_config: Config) -> None:
    """Issue 40, item 6: `promote` answered a made-up 1 ("how many were committed") on a
    timeout; it now answers a typed outcome: nothing committed yet, still running."""
    blocks = random_blocks(9)
    await store_and_stop(disk_config, blocks)
    config = replace(disk_config, disk_promote_timeout=1e-6)
    async with started(config, ManualClock()) as server, Client(server.address, tenant="a") as kv:
        ns = await kv.register_namespace("disk-model", LAYOUT)
        chain = chain_of(ns, TOKENS)
        promoter = server.node.promoter
        assert promoter is not None
        outcome = await promoter.promote(ns.id, TenantId("a"), chain, 0)
        assert (outcome.committed, outcome.pending, outcome.look_again) == (0, True, True)
        await until(lambda: promoter.promoted_blocks, what="the promotion to finish on its own")


async def test_a_late_write_into_a_promotions_slot_is_a_miss(disk_config: Config) -> None:
    """The promotion hashed its slots after the tier's verified read and committed that
    hash (issue 40, item 2's gap, on the node's side): a late writer's copy landing in
    between was committed as good. It is now compared with the disk's checksum."""
    blocks = random_blocks(10)
    await store_and_stop(disk_config, blocks)
    async with (
        started(disk_config, ManualClock()) as server,
        Client(server.address, tenant="a") as kv,
    ):
        ns = await kv.register_namespace("disk-model", LAYOUT)
        disk = server.node.disk
        assert disk is not None
        real_read = disk.tier.read_many

        async def late_write_after_the_read(keys: list[DiskKey], dests: list[memoryview]) -> Any:
            verdicts = await real_read(keys, dests)
            dests[1][:] = bytes([0xEE]) * len(dests[1])  # a late copy lands on block 1's slot
            return verdicts

        disk.tier.read_many = late_write_after_the_read  # type: ignore[method-assign]
        hit = await kv.lookup(ns, TOKENS, pin=True)
        assert hit.hit_blocks == 1  # block 1 (and the rest of the chain) is a miss
        assert await kv.read_blocks(hit) == blocks[:1]
        await kv.release(hit)
        assert metric(server, "kvstore_checksum_failures_total", namespace=ns.id, tier="local") == 1
