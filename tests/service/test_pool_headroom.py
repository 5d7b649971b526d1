"""Pools keep free memory ready ahead of their stores (``pool_headroom_bytes``).

The policy is in service/memory/policy.py.

RegisterNamespace builds the headroom with the first arena; a commit that
leaves less starts building the next arena in the background, never on a
Reserve's path (nor during the runner's copy); growth ahead of need spends
only free budget and stops at the pool's ceiling; a failure to build is
logged, never fatal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from kvstore.errors import LimitExceeded
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.config import Config
from service.server import Server
from tests.inproc import BLOCK_BYTES, BLOCK_SIZE, LAYOUT
from tests.replies import entries_of
from tests.service.pool_stores import REAL_LAYOUT, store
from tests.stand_ins import stand_in_checksums
from tests.waiting import until

ARENA_BLOCKS = 16
"""Slots per arena of the small config (arena_bytes = 16 blocks)."""


@dataclasses.dataclass
class Node:
    server: Server
    stub: kvstore_pb2_grpc.KVStoreStub

    async def register(self, model: str) -> pb.RegisterNamespaceResponse:
        return await self.stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id=model, layout=LAYOUT), timeout=5
        )

    async def arenas(self, ns: str) -> int:
        return len((await self.stub.AttachPool(pb.AttachPoolRequest(namespace_id=ns))).arenas)

    async def lease(self) -> int:
        return int((await self.stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=60))).lease_id)


async def _start(config: Config) -> AsyncIterator[Node]:
    server = Server(config, expiry_tick=0.05)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield Node(server, kvstore_pb2_grpc.KVStoreStub(channel))
    finally:
        await server.stop(0.1)


def small_config(tmp_path: Any, **changes: Any) -> Config:
    """16-block arenas, pools of up to 4 arenas, 2 arenas of headroom unless changed."""
    config = Config(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        capacity_bytes=1 << 20,
        namespace_capacity_bytes=4 * ARENA_BLOCKS * BLOCK_BYTES,
        arena_bytes=ARENA_BLOCKS * BLOCK_BYTES,
        pool_headroom_bytes=2 * ARENA_BLOCKS * BLOCK_BYTES,
        shm_dir=str(tmp_path),
        pool_prefix=f"kvhead{uuid.uuid4().hex[:8]}",
        pool_prefault=False,
        salt_secret=bytes(range(32)),
        grace_seconds=0.1,
    )
    return dataclasses.replace(config, **changes)


@pytest.fixture
async def node(tmp_path: Any) -> AsyncIterator[Node]:
    async for started in _start(small_config(tmp_path)):
        yield started


def tokens_of(n_blocks: int, seed: int) -> list[int]:
    return [seed * 100_000 + i for i in range(n_blocks * BLOCK_SIZE)]


def growing(node: Node) -> bool:
    """Whether the node is building headroom in the background now (its growth tasks)."""
    return bool(node.server.node.memory._ahead)


async def settled(node: Node, after: str) -> None:
    """Wait until no background growth is in flight: what ``after`` could start has ended."""
    await until(lambda: not growing(node), within=5.0, what=f"no growth in flight after {after}")


class HeldBuilds:
    """Every arena build waits (in its worker thread) until `go` is set; counts the builds begun."""

    def __init__(self, server: Server) -> None:
        pools = server.node.pools
        real = pools.build_arena
        self.go = threading.Event()
        self.begun = 0

        def build(*args: Any) -> Any:
            self.begun += 1
            assert self.go.wait(10), "the test never let the build finish"
            return real(*args)

        pools.build_arena = build  # type: ignore[method-assign]


async def test_a_new_pool_starts_with_its_headroom(node: Node) -> None:
    reg = await node.register("m")
    assert reg.capacity_blocks == 2 * ARENA_BLOCKS  # one arena + one for 32 free slots
    assert await node.arenas(reg.namespace_id) == 2


async def test_the_headroom_stops_at_the_pools_ceiling(tmp_path: Any) -> None:
    config = small_config(tmp_path, pool_headroom_bytes=100 * ARENA_BLOCKS * BLOCK_BYTES)
    async for node in _start(config):
        reg = await node.register("m")
        assert reg.capacity_blocks == 4 * ARENA_BLOCKS  # the ceiling, not the whole budget
        assert node.server.node.pools.free_bytes == (1 << 20) - 4 * ARENA_BLOCKS * BLOCK_BYTES


async def test_a_commit_into_the_headroom_grows_the_pool_in_the_background(node: Node) -> None:
    reg = await node.register("m")
    ns, lid = reg.namespace_id, await node.lease()
    before = await node.stub.AttachPool(pb.AttachPoolRequest(namespace_id=ns))
    held = HeldBuilds(node.server)
    # 20 of the 32 free slots: 12 left, under the headroom of 32. Nothing is built
    # while the runner copies (between its Reserve and its commit) ...
    res = await node.stub.Reserve(
        pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=tokens_of(20, 1))
    )
    assert all(e.status == pb.RESERVE_STATUS_RESERVED for e in entries_of(res))
    assert res.pool_version == before.pool_version  # no arena was added on its path
    await settled(node, "the Reserve")
    assert held.begun == 0
    # ... the commit starts it, and answers while the arena is still being built.
    commit = await asyncio.wait_for(
        node.stub.Commit(
            pb.CommitRequest(
                namespace_id=ns,
                lease_id=lid,
                packed_hashes=b"".join([e.hash for e in entries_of(res)]),
                packed_checksums=stand_in_checksums(b"".join([e.hash for e in entries_of(res)])),
            )
        ),
        5,
    )
    assert commit.committed == 20
    await until(lambda: held.begun > 0, within=5.0, what="the arena build to begin")
    assert await node.arenas(ns) == 2
    # A Reserve that fits the free slots never waits for the arena being built.
    more = await asyncio.wait_for(
        node.stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=tokens_of(4, 9))),
        5,
    )
    assert all(e.status == pb.RESERVE_STATUS_RESERVED for e in entries_of(more))
    held.go.set()
    # 64 slots (the ceiling) hold 40 free: the headroom is back.
    await until(lambda: node.arenas(ns), ok=lambda n: n == 4, within=5.0, what="4 arenas")
    after = await node.stub.AttachPool(pb.AttachPoolRequest(namespace_id=ns))
    assert after.arenas[:2] == before.arenas[:2]  # arenas are added at the end


async def test_a_reserve_beyond_the_free_slots_still_grows_on_its_path(node: Node) -> None:
    reg = await node.register("m")
    ns, lid = reg.namespace_id, await node.lease()
    res = await store(node.stub, ns, lid, tokens_of(40, 2))  # 32 free: 8 more needed now
    assert sum(e.status == pb.RESERVE_STATUS_RESERVED for e in entries_of(res)) == 40
    await until(lambda: node.arenas(ns), ok=lambda n: n == 4, within=5.0, what="4 arenas")


async def test_growth_ahead_of_need_takes_no_arena_from_other_namespaces(tmp_path: Any) -> None:
    # A budget of 3 arenas: the first pool takes 2 (one and its headroom), the second 1.
    config = small_config(tmp_path, capacity_bytes=3 * ARENA_BLOCKS * BLOCK_BYTES)
    async for node in _start(config):
        first = await node.register("a")
        second = await node.register("b")
        assert (first.capacity_blocks, second.capacity_blocks) == (32, 16)
        lid = await node.lease()
        await store(node.stub, second.namespace_id, lid, tokens_of(10, 3))  # under its headroom
        await settled(node, "the store")
        assert await node.arenas(first.namespace_id) == 2  # kept: nothing was taken back
        assert await node.arenas(second.namespace_id) == 1


async def test_a_full_tmpfs_while_building_headroom_is_logged_not_fatal(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    pools = node.server.node.pools
    real = pools.build_arena
    built: list[int] = []

    def build(*args: Any) -> Any:
        if built:  # the first arena of a pool is made, the next ones find tmpfs full
            raise LimitExceeded("no room for a 4096-byte arena: the filesystem is full")
        built.append(1)
        return real(*args)

    pools.build_arena = build  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="service.memory.policy"):
        reg = await node.register("m")
    assert reg.capacity_blocks == ARENA_BLOCKS  # registered, without its headroom
    assert "cannot add an arena" in caplog.text and "full" in caplog.text
    lid = await node.lease()
    res = await store(node.stub, reg.namespace_id, lid, tokens_of(8, 4))
    assert all(e.status == pb.RESERVE_STATUS_RESERVED for e in entries_of(res))


async def test_stopping_the_node_while_headroom_is_built_leaves_no_files(tmp_path: Any) -> None:
    config = small_config(tmp_path)
    async for node in _start(config):
        reg = await node.register("m")
        held = HeldBuilds(node.server)
        await store(node.stub, reg.namespace_id, await node.lease(), tokens_of(20, 5))
        # The background growth waits in its thread.
        await until(lambda h=held: h.begun > 0, within=5.0, what="the background build to begin")
        asyncio.get_running_loop().call_later(0.1, held.go.set)
        await node.server.stop(0.1)
    assert [p for p in tmp_path.iterdir() if p.name.startswith(config.pool_prefix)] == []


async def test_the_default_headroom_still_fits_sixteen_namespaces_in_the_default_budget(
    tmp_path: Any,
) -> None:
    """The first pools take their headroom; later registrations take it back, as needed."""
    config = Config(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        shm_dir=str(tmp_path),
        pool_prefix=f"kvhead{uuid.uuid4().hex[:8]}",
        pool_prefault=False,  # sparse files: the test need not touch 1 GiB
        salt_secret=bytes(range(32)),
        grace_seconds=0.1,
    )
    assert (config.capacity_bytes, config.arena_bytes) == (1 << 30, 64 << 20)
    assert config.pool_headroom_bytes == Config().pool_headroom_bytes == 128 << 20
    async for node in _start(config):
        first = await node.stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id="model-0", layout=REAL_LAYOUT)
        )
        assert first.capacity_blocks == 2 * 256  # 64 MiB arenas of 256 KiB blocks
        for i in range(1, 16):
            await node.stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(model_id=f"model-{i}", layout=REAL_LAYOUT)
            )
        stats = await node.stub.Stats(pb.StatsRequest())
        assert len(stats.namespaces) == 16 and stats.allocated_bytes == 1 << 30
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await node.stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(model_id="one-too-many", layout=REAL_LAYOUT)
            )
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
