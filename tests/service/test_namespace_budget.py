"""Namespaces share the node's memory budget arena by arena (service/memory/policy.py).

A pool starts with one arena, grows before a Reserve that lacks free slots,
gives its last arena back when another namespace needs memory, and a dropped
namespace gives all of it back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import grpc
import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.config import Config
from service.server import Server
from tests.inproc import BLOCK_BYTES, BLOCK_SIZE, LAYOUT
from tests.replies import blocks_of, chain_of, entries_of
from tests.service.pool_stores import REAL_LAYOUT, payload, store

ARENA_BLOCKS = 16
"""Slots per arena in the small config of the conftest (arena_bytes = 16 blocks)."""


def tokens_of(n_blocks: int, seed: int) -> list[int]:
    return [seed * 100_000 + i for i in range(n_blocks * BLOCK_SIZE)]


async def read_back(stub, ns: str, lid: int, tokens: list[int]) -> tuple[int, list[bytes]]:
    hit = await stub.Lookup(
        pb.LookupRequest(namespace_id=ns, lease_id=lid, pin=True, tokens=tokens)
    )
    refs = [pb.BlockRef(hash=b.hash, slot=b.slot, generation=b.generation) for b in blocks_of(hit)]
    data = [m.data async for m in stub.ReadBlocks(pb.ReadBlocksRequest(
        namespace_id=ns, lease_id=lid, blocks=refs))]  # fmt: skip
    await stub.Release(
        pb.ReleaseRequest(namespace_id=ns, lease_id=lid, packed_hashes=b"".join(chain_of(hit)))
    )
    return hit.hit_blocks, data


def by_model(stats: pb.StatsResponse) -> dict[str, pb.NamespaceStats]:
    return {ns.model_id: ns for ns in stats.namespaces}


# --- the default budget ------------------------------------------------------------------


@pytest.fixture
async def default_budget(tmp_path):
    config = Config(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        shm_dir=str(tmp_path),
        pool_prefix=f"kvbudget{uuid.uuid4().hex[:8]}",
        pool_prefault=False,  # sparse files: the test need not touch 1 GiB
        pool_headroom_bytes=0,  # arenas on need only (test_pool_headroom: the default headroom)
        salt_secret=bytes(range(32)),
        grace_seconds=0.1,
        max_message_bytes=8 << 20,
    )
    defaults = Config()
    assert (config.capacity_bytes, config.arena_bytes) == (1 << 30, 64 << 20)
    assert (defaults.capacity_bytes, defaults.arena_bytes) == (1 << 30, 64 << 20)
    server = Server(config, expiry_tick=0.05)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(
            server.address, options=[("grpc.max_receive_message_length", 8 << 20)]
        ) as channel:
            yield kvstore_pb2_grpc.KVStoreStub(channel)
    finally:
        await server.stop(0.1)


async def test_ten_namespaces_fit_the_default_budget_and_one_drops(default_budget):
    stub = default_budget
    lid = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=60))).lease_id
    block_bytes = 2 * 4 * 16 * 8 * 128 * 2
    prompt = list(range(3 * 16))
    ids = []
    for i in range(10):
        reg = await stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id=f"model-{i}", layout=REAL_LAYOUT)
        )
        assert reg.created and reg.capacity_blocks == (64 << 20) // block_bytes
        ids.append(reg.namespace_id)
        res = await stub.Reserve(
            pb.ReserveRequest(namespace_id=reg.namespace_id, lease_id=lid, tokens=prompt)
        )
        hashes = [e.hash for e in entries_of(res)]

        async def writes(ns=reg.namespace_id, hashes=hashes, i=i):
            yield pb.WriteBlocksRequest(
                header=pb.WriteBlocksHeader(namespace_id=ns, lease_id=lid, commit=True)
            )
            for h in hashes:
                yield pb.WriteBlocksRequest(
                    block=pb.BlockData(hash=h, data=payload(h, i, block_bytes))
                )

        assert (await stub.WriteBlocks(writes())).committed == 3
    for i, ns in enumerate(ids):  # every namespace reads its own bytes back
        hits, data = await read_back(stub, ns, lid, prompt)
        assert hits == 3 and all(d[0] == i for d in data) and len(data[0]) == block_bytes
    stats = await stub.Stats(pb.StatsRequest())
    assert len(stats.namespaces) == 10 and stats.allocated_bytes == 10 * (64 << 20)

    dropped = await stub.DropNamespace(pb.DropNamespaceRequest(namespace_id=ids[3]))
    assert dropped.removed == 3 and dropped.freed_bytes == 64 << 20
    stats = await stub.Stats(pb.StatsRequest())
    assert len(stats.namespaces) == 9 and stats.allocated_bytes == 9 * (64 << 20)
    assert "model-3" not in by_model(stats)

    # Six more fill the budget exactly (16 arenas of 64 MiB); the next one is refused.
    for i in range(10, 17):
        await stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id=f"model-{i}", layout=REAL_LAYOUT)
        )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id="one-too-many", layout=REAL_LAYOUT)
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no room" in err.value.details() and "drop one" in err.value.details()
    assert (await stub.Stats(pb.StatsRequest())).allocated_bytes == 1 << 30


# --- growth and give-back (small config: 16-block arenas, a 1 MiB budget) ---------------------


async def test_a_pool_grows_arena_by_arena_on_demand(stub, namespace):
    ns = namespace.id
    assert namespace.capacity == ARENA_BLOCKS
    lid = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=60))).lease_id
    first = await stub.AttachPool(pb.AttachPoolRequest(namespace_id=ns))
    tokens = tokens_of(40, 1)
    res = await store(stub, ns, lid, tokens)
    assert all(e.status == pb.RESERVE_STATUS_RESERVED for e in entries_of(res))
    assert max(e.location.arena for e in entries_of(res)) == 2
    assert res.pool_version != first.pool_version
    after = await stub.AttachPool(pb.AttachPoolRequest(namespace_id=ns))
    assert len(after.arenas) == 3 and after.capacity_blocks == 3 * ARENA_BLOCKS
    assert after.arenas[0].path == first.arenas[0].path  # arena 0 stays where it was
    assert after.pool_version == res.pool_version and after.pool_epoch == first.pool_epoch
    hits, data = await read_back(stub, ns, lid, tokens)
    assert hits == 40 and data == [payload(e.hash, 1) for e in entries_of(res)]
    (ns_stats,) = (await stub.Stats(pb.StatsRequest())).namespaces
    assert ns_stats.capacity == 48 and ns_stats.evictions == 0


async def test_the_ceiling_bounds_growth_then_own_blocks_are_evicted(stub):
    reg = await stub.RegisterNamespace(
        pb.RegisterNamespaceRequest(
            model_id="capped", layout=LAYOUT, capacity_bytes=40 * BLOCK_BYTES
        )
    )
    lid = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=60))).lease_id
    await store(stub, reg.namespace_id, lid, tokens_of(30, 1))
    await store(stub, reg.namespace_id, lid, tokens_of(30, 2))
    (ns,) = (await stub.Stats(pb.StatsRequest())).namespaces
    assert ns.capacity == 32 and ns.evictions == 28  # two arenas of 16: 40 rounded down


@pytest.fixture
def server_config(server_config: Config) -> Config:
    """The conftest's small config with a budget of 4 arenas."""
    return dataclasses.replace(
        server_config, capacity_bytes=4 * ARENA_BLOCKS * BLOCK_BYTES, namespace_capacity_bytes=0
    )


async def test_an_arena_is_taken_back_from_a_bigger_idle_namespace(stub, clock):
    lid = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=600))).lease_id
    a = (
        await stub.RegisterNamespace(pb.RegisterNamespaceRequest(model_id="a", layout=LAYOUT))
    ).namespace_id
    await store(stub, a, lid, tokens_of(3 * ARENA_BLOCKS, 1))  # a grows to 3 of the 4 arenas
    b = (
        await stub.RegisterNamespace(pb.RegisterNamespaceRequest(model_id="b", layout=LAYOUT))
    ).namespace_id
    stats = await stub.Stats(pb.StatsRequest())
    assert stats.allocated_bytes == stats.capacity_bytes
    watch = stub.WatchEvents(pb.WatchEventsRequest(namespace_id=a))
    await watch.initial_metadata()

    clock.advance(1)
    res = await store(stub, b, lid, tokens_of(2 * ARENA_BLOCKS, 2), fill=2)
    assert all(e.status == pb.RESERVE_STATUS_RESERVED for e in entries_of(res))
    stats = by_model(await stub.Stats(pb.StatsRequest()))
    assert stats["a"].capacity == 2 * ARENA_BLOCKS and stats["b"].capacity == 2 * ARENA_BLOCKS
    assert stats["a"].evictions == ARENA_BLOCKS and stats["a"].ready == 2 * ARENA_BLOCKS
    removed = await asyncio.wait_for(watch.read(), 5)
    watch.cancel()
    assert removed.kind == pb.EVENT_KIND_REMOVED and len(removed.hashes) == ARENA_BLOCKS
    hits, data = await read_back(stub, a, lid, tokens_of(3 * ARENA_BLOCKS, 1))
    assert hits == 2 * ARENA_BLOCKS and all(d[0] == 1 for d in data)  # the first 32 blocks stay

    # Equal shares now: b cannot take more, its reserve evicts its own blocks instead.
    await store(stub, b, lid, tokens_of(ARENA_BLOCKS, 3), fill=3)
    stats = by_model(await stub.Stats(pb.StatsRequest()))
    assert stats["a"].capacity == stats["b"].capacity == 2 * ARENA_BLOCKS
    assert stats["b"].evictions == ARENA_BLOCKS


async def test_pinned_blocks_keep_their_arena_and_a_full_budget_is_no_room(stub):
    lid = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=600))).lease_id
    a = (
        await stub.RegisterNamespace(pb.RegisterNamespaceRequest(model_id="a", layout=LAYOUT))
    ).namespace_id
    tokens_a = tokens_of(4 * ARENA_BLOCKS, 1)
    await store(stub, a, lid, tokens_a)  # the whole budget
    await stub.Lookup(pb.LookupRequest(namespace_id=a, lease_id=lid, pin=True, tokens=tokens_a))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RegisterNamespace(pb.RegisterNamespaceRequest(model_id="b", layout=LAYOUT))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    more = await stub.Reserve(
        pb.ReserveRequest(namespace_id=a, lease_id=lid, tokens=tokens_of(2, 9))
    )
    assert [e.status for e in entries_of(more)] == [pb.RESERVE_STATUS_NO_ROOM] * 2  # not a crash

    # Released: the namespace may now give its last arena to a newcomer.
    hashes = [
        e.hash
        for e in blocks_of(await stub.Lookup(pb.LookupRequest(namespace_id=a, tokens=tokens_a)))
    ]
    await stub.Release(
        pb.ReleaseRequest(namespace_id=a, lease_id=lid, packed_hashes=b"".join(hashes))
    )
    b = await stub.RegisterNamespace(pb.RegisterNamespaceRequest(model_id="b", layout=LAYOUT))
    assert b.created and b.capacity_blocks == ARENA_BLOCKS
    stats = by_model(await stub.Stats(pb.StatsRequest()))
    assert stats["a"].capacity == 3 * ARENA_BLOCKS


# --- the SDK maps a grown pool's new arenas ----------------------------------------------------

SDK_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float16")


def sdk_block(i: int) -> np.ndarray:
    return np.full(SDK_LAYOUT.block_shape, i + 0.25, np.float16)


async def test_the_sdk_maps_new_arenas_without_an_epoch_change(kv_server: Server):
    async with Client(kv_server.address, tenant="acme", timeout=5.0) as kv:
        ns = await kv.register_namespace("grows", SDK_LAYOUT)
        mapping = ns.mapping
        assert mapping is not None and len(mapping.descriptor.arenas) == 1
        early = tokens_of(4, 1)
        await kv.store(ns, early, [sdk_block(i) for i in range(4)])
        before = await kv.lookup(ns, early, pin=True)
        epoch = kv.epoch

        late = tokens_of(30, 2)  # needs two more arenas
        result = await kv.store(ns, late, [sdk_block(100 + i) for i in range(30)])
        assert result.committed == 30 and kv.epoch == epoch
        assert ns.mapping is mapping and len(mapping.descriptor.arenas) == 3  # refreshed in place

        hit = await kv.lookup(ns, late, pin=True)
        arenas = {b.arena for b in hit.blocks}
        assert arenas == {0, 1, 2}  # 30 missing, 12 free: two arenas added
        for i, view in enumerate(hit.numpy_views()):
            assert np.array_equal(view, sdk_block(100 + i))
        assert await kv.read_blocks(hit) == [sdk_block(100 + i).tobytes() for i in range(30)]
        # A hit taken before the growth still reads through the same mapping.
        for i, view in enumerate(before.numpy_views()):
            assert np.array_equal(view, sdk_block(i))
        await kv.release(hit)
        await kv.release(before)


async def test_a_runner_never_reads_a_dropped_pool_after_it_is_registered_again(kv_server):
    async with (
        Client(kv_server.address, tenant="acme", timeout=5.0) as old,
        Client(kv_server.address, tenant="acme", timeout=5.0) as new,
    ):
        ns = await old.register_namespace("again", SDK_LAYOUT)
        tokens = tokens_of(3, 7)
        await old.store(ns, tokens, [sdk_block(i) for i in range(3)])
        async with grpc.aio.insecure_channel(kv_server.address) as channel:
            admin = kvstore_pb2_grpc.KVStoreStub(channel)
            await admin.DropNamespace(pb.DropNamespaceRequest(namespace_id=ns.id))
        # Another runner registers the same model again and stores other bytes.
        ns_new = await new.register_namespace("again", SDK_LAYOUT)
        assert ns_new.id == ns.id
        await new.store(ns_new, tokens, [sdk_block(50 + i) for i in range(3)])
        # The first runner still holds a mapping of the dropped files: the answer's
        # pool version differs, so it maps the new pool before handing out views.
        hit = await old.lookup(ns, tokens, pin=True)
        assert hit.hit_blocks == 3
        for i, view in enumerate(hit.numpy_views()):
            assert np.array_equal(view, sdk_block(50 + i))
        await old.release(hit)


async def test_an_empty_namespace_gives_its_arenas_back_whatever_its_share(stub, clock):
    lid = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=600))).lease_id
    ids = {}
    for name in ("a", "b"):
        reg = await stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id=name, layout=LAYOUT)
        )
        ids[name] = reg.namespace_id
        await store(stub, reg.namespace_id, lid, tokens_of(2 * ARENA_BLOCKS, 1))  # 2 arenas each
    await stub.Clear(pb.ClearRequest(namespace_id=ids["a"]))
    clock.advance(2)  # past the retry pause of b's last (failed) growth, if any
    await store(stub, ids["b"], lid, tokens_of(ARENA_BLOCKS, 2))
    stats = by_model(await stub.Stats(pb.StatsRequest()))
    assert stats["a"].capacity == ARENA_BLOCKS and stats["b"].capacity == 3 * ARENA_BLOCKS
    assert stats["b"].evictions == 0


async def test_another_process_follows_the_pool_version_of_a_lookup(kv_server):
    """The vLLM split: the scheduler looks up, the worker reads the slots through its mapping."""
    async with (
        Client(kv_server.address, tenant="acme", timeout=5.0) as scheduler,
        Client(kv_server.address, tenant="acme", timeout=5.0) as worker,
    ):
        ns_w = await worker.register_namespace("split", SDK_LAYOUT)
        ns_s = await scheduler.register_namespace("split", SDK_LAYOUT)
        tokens = tokens_of(30, 4)
        await scheduler.store(ns_s, tokens, [sdk_block(i) for i in range(30)])  # grows the pool
        hit = await scheduler.lookup(ns_s, tokens, pin=True)
        assert ns_w.mapping is not None
        assert hit.pool_version > ns_w.mapping.descriptor.version
        with pytest.raises(InvalidArgument):
            ns_w.mapping.buffer(hit.blocks[-1].slot)  # an arena the worker has not mapped
        await worker.follow_pool(ns_w, hit.pool_version)
        mapping = ns_w.mapping
        for i, b in enumerate(hit.blocks):
            assert np.array_equal(mapping.numpy_view(b.slot, SDK_LAYOUT), sdk_block(i))
        await worker.follow_pool(ns_w, hit.pool_version)  # nothing to do now
        assert ns_w.mapping is mapping
        await scheduler.release(hit)
