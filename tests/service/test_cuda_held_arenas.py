"""A CUDA node never frees an arena a runner still has open (`service.memory.held`).

CUDA leaves ``cudaFree`` of an exported allocation that another process still
has open through ``cudaIpcOpenMemHandle`` undefined; the fake runtime makes it
an error (``FREED_WHILE_IMPORTED``). An arena given back under memory pressure,
or of a dropped namespace, is held (its bytes still allocated) until no live
lease reports mapping an older pool version: the runner follows the new
version (its KeepAlive says so), or its lease ends.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import grpc
import pytest
import torch

from kvstore.client import Client
from kvstore.errors import LimitExceeded
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.server import Server
from tests.kvstore.pool.fake_cuda import FakeCudaRuntime
from tests.service.cuda_node import threaded_node

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float16")
ARENA = 2 << 20
"""A CUDA arena's cost in the budget: a whole IPC block."""


@pytest.fixture
def rt() -> FakeCudaRuntime:
    return FakeCudaRuntime(uuids=[UUID0], total_bytes=1 << 25)


@pytest.fixture
def node(server_config, rt) -> Iterator[Server]:
    config = dataclasses.replace(
        server_config, device="cuda:0", capacity_bytes=2 * ARENA, namespace_capacity_bytes=0
    )
    with threaded_node(config, rt) as server:
        yield server


def blocks(n: int) -> list[torch.Tensor]:
    return [torch.full(LAYOUT.block_shape, float(i)).half() for i in range(n)]


async def admin(server: Server, method: str, request: object, tenant: str = "") -> object:
    metadata = (("x-kvstore-tenant", tenant),) if tenant else ()
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        return await getattr(stub, method)(request, timeout=10, metadata=metadata)


async def test_a_dropped_namespaces_arena_is_freed_once_its_runner_lets_go(node, rt, caplog):
    caplog.set_level(logging.ERROR)
    held = node.node.pools.held
    async with Client(node.address, tenant="acme", timeout=5.0) as kv:
        ns = await kv.register_namespace("m", LAYOUT)
        await kv.store(ns, list(range(8)), blocks(2))  # opens the lease: it reports the mapping
        allocations = set(rt.allocations)
        await admin(node, "DropNamespace", pb.DropNamespaceRequest(namespace_id=ns.id))
        assert held.count == 1 and set(rt.allocations) == allocations  # still mapped: kept
        assert node.node.pools.allocated_bytes == ARENA  # and still counted
        ns.mapping.close()  # the runner lets go of the dropped pool ...
        ns.mapping = None
        assert await kv.lease.renew_now()  # ... and says so with its next KeepAlive
        assert held.count == 0 and not rt.allocations
        assert node.node.pools.allocated_bytes == 0
    assert [r.getMessage() for r in caplog.records] == []


async def test_a_runner_closing_or_losing_its_lease_frees_what_it_held(node, rt, caplog):
    caplog.set_level(logging.ERROR)
    held = node.node.pools.held
    async with Client(node.address, tenant="acme", timeout=5.0) as kv:
        ns = await kv.register_namespace("m", LAYOUT)
        await kv.store(ns, list(range(8)), blocks(2))
        await admin(node, "DropNamespace", pb.DropNamespaceRequest(namespace_id=ns.id))
        assert held.count == 1
    # Closing the client unmapped the pool, then ended the lease: nothing is held.
    assert held.count == 0 and not rt.allocations
    assert [r.getMessage() for r in caplog.records] == []


async def test_an_arena_given_back_under_pressure_waits_for_its_runner(node, rt, caplog):
    caplog.set_level(logging.ERROR)
    held = node.node.pools.held
    async with (
        Client(node.address, tenant="acme", timeout=5.0) as a,
        Client(node.address, tenant="acme", timeout=5.0) as b,
    ):
        ns_a = await a.register_namespace("a", LAYOUT)
        per_arena = ns_a.capacity
        tokens = list(range(4 * (per_arena + 1)))
        stored = await a.store(ns_a, tokens, blocks(per_arena + 1))  # grows to 2 arenas
        assert stored.committed == per_arena + 1
        hit = await a.lookup(ns_a, tokens, pin=True)  # a's mapping follows both arenas
        assert hit.hit_blocks == per_arena + 1
        await a.release(hit)
        # b needs an arena: a gives its last one back, but a's runner still maps it.
        with pytest.raises(LimitExceeded):
            await b.register_namespace("b", LAYOUT)
        assert held.count == 1
        # a's runner follows the new arena set (its next answer names it) and says so.
        again = await a.lookup(ns_a, tokens[: 4 * per_arena], pin=True)
        await a.release(again)
        assert ns_a.mapping is not None and len(ns_a.mapping.descriptor.arenas) == 1
        assert await a.lease.renew_now()
        assert held.count == 0
        ns_b = await b.register_namespace("b", LAYOUT)  # now there is room
        assert ns_b.capacity == per_arena
    assert [r.getMessage() for r in caplog.records] == []


async def test_a_report_keeps_only_namespaces_the_node_has(node, rt):
    """A KeepAlive may name any number of namespaces: only the node's own are kept."""
    held = node.node.pools.held
    async with Client(node.address, tenant="acme", timeout=5.0) as kv:
        ns = await kv.register_namespace("m", LAYOUT)
        await kv.store(ns, list(range(8)), blocks(2))
        lease = kv.lease.lease_id
        bogus = [pb.PoolVersion(namespace_id=f"ns{i}", version=1) for i in range(1000)]
        await admin(
            node,
            "KeepAlive",
            pb.KeepAliveRequest(
                lease_id=lease,
                pool_versions=[*bogus, pb.PoolVersion(namespace_id=ns.id, version=7)],
            ),
            tenant="acme",
        )
        assert held._follows[lease] == {ns.id: 7}
