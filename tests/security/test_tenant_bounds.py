"""Auth off: made-up tenant names must not grow the node without bound.

With auth off any client may name any tenant (``x-kvstore-tenant``). Every
per-tenant structure of the node is bounded: metric label values
(``max_tenant_labels``, the rest fold into ``_other``), the per-namespace
lookup counters the core keeps (and Stats returns), the core's per-scope
block dicts, and the cache of chain roots.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest

from kvstore.tenant_counters import OTHER_TENANTS, TenantCounterBook
from kvstore.types import SHARED_SCOPE, TenantId
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.config import Config
from service.server import Server
from service.tenancy.callers import ROOT_CACHE_SIZE
from tests.inproc import BLOCK_SIZE, LAYOUT, ManualClock
from tests.replies import entries_of
from tests.stand_ins import stand_in_checksums
from tests.tenants import ALICE_TOKEN, BOB_TOKEN, bearer, register

TENANTS = 100_000
"""Distinct tenant names sent through the node (the issue's figure)."""
WRITERS = 1_000
"""Of those, tenants that also store a block (evicted again: capacity 64)."""
LABELS = 100
"""The node's max_tenant_labels (the default)."""
CONCURRENCY = 256


@pytest.fixture
async def open_node(server_config: Config) -> AsyncIterator[Server]:
    assert server_config.tenants_file == "" and server_config.max_tenant_labels == LABELS
    server = Server(replace(server_config, stats_sample_seconds=3600), clock=ManualClock())
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0.1)


def tenant(i: int) -> tuple[tuple[str, str], ...]:
    """Metadata naming a made-up tenant (auth off trusts it)."""
    return (("x-kvstore-tenant", f"made-up-{i}"),)


async def in_batches(n: int, call) -> None:
    for start in range(0, n, CONCURRENCY):
        await asyncio.gather(*(call(i) for i in range(start, min(n, start + CONCURRENCY))))


def label_values(exposition: str, label: str) -> set[str]:
    return set(re.findall(rf'{label}="([^"]*)"', exposition))


@pytest.mark.timeout(600)
async def test_100k_made_up_tenants_leave_the_node_bounded(open_node: Server):
    node = open_node.node
    async with grpc.aio.insecure_channel(open_node.address) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        ns = (
            await stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(model_id="m", layout=LAYOUT), timeout=5
            )
        ).namespace_id
        tokens = list(range(BLOCK_SIZE))

        async def look(i: int) -> None:
            await stub.Lookup(
                pb.LookupRequest(namespace_id=ns, tokens=tokens), metadata=tenant(i), timeout=30
            )

        async def write(i: int) -> None:
            md = tenant(i)
            lid = (await stub.OpenLease(pb.OpenLeaseRequest(), metadata=md, timeout=30)).lease_id
            res = await stub.Reserve(
                pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=tokens),
                metadata=md,
                timeout=30,
            )
            await stub.Commit(
                pb.CommitRequest(
                    namespace_id=ns,
                    lease_id=lid,
                    packed_hashes=b"".join([e.hash for e in entries_of(res)]),
                    packed_checksums=stand_in_checksums(
                        b"".join([e.hash for e in entries_of(res)])
                    ),
                ),
                metadata=md,
                timeout=30,
            )
            await stub.CloseLease(pb.CloseLeaseRequest(lease_id=lid), metadata=md, timeout=30)

        await in_batches(TENANTS, look)
        await in_batches(WRITERS, write)
        stats = await stub.Stats(pb.StatsRequest(), timeout=30)

    # Metrics: at most LABELS tenant label values plus _other, and nothing lost.
    text = node.metrics.render().decode()
    lookup_lines = [line for line in text.splitlines() if line.startswith("kvstore_lookup_")]
    tenants_seen = label_values("\n".join(lookup_lines), "tenant")
    assert len(tenants_seen) == LABELS + 1 and OTHER_TENANTS in tenants_seen
    assert len(lookup_lines) <= 2 * 2 * 2 * (LABELS + 1)  # 2 metrics x hit/miss x _total/_created
    assert len(node.metrics.tenant_labels) == LABELS
    registry = node.metrics.registry
    misses = sum(
        registry.get_sample_value(
            "kvstore_lookup_blocks_total", {"namespace": ns, "tenant": t, "result": "miss"}
        )
        or 0
        for t in tenants_seen
    )
    assert misses == TENANTS  # every lookup missed once, folded or not
    assert len(text) < 200_000

    # Stats (and the core's per-tenant counters behind it): bounded, nothing lost.
    (ns_stats,) = stats.namespaces
    capacity = ns_stats.capacity
    assert len(ns_stats.tenants) == LABELS + 1  # scopes holding blocks fold too
    assert sum(t.lookups for t in ns_stats.tenants) == TENANTS
    assert sum(t.stored_blocks for t in ns_stats.tenants) == WRITERS
    table = node.table(ns)
    assert table.stats().evictions >= WRITERS - capacity  # the writers' blocks came and went
    # The core keeps one block dict per scope that holds blocks, never one per name seen.
    assert len(table._res._scopes) <= capacity  # private: no public count

    # Chain roots: cached per (namespace, tenant), bounded.
    assert len(node.roots) <= ROOT_CACHE_SIZE
    # Leases: the per-tenant lease counts drop to nothing once closed.
    assert node.store.stats().leases == 0


async def test_with_auth_on_every_tenant_of_the_file_keeps_its_own_label(auth_config: Config):
    server = Server(replace(auth_config, max_tenant_labels=1), clock=ManualClock())
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            for token in (ALICE_TOKEN, BOB_TOKEN):
                ns = (await register(stub, token)).namespace_id
                await stub.Lookup(
                    pb.LookupRequest(namespace_id=ns, tokens=list(range(BLOCK_SIZE))),
                    metadata=bearer(token),
                    timeout=5,
                )
        text = server.node.metrics.render().decode()
        assert label_values(text, "tenant") == {"alice", "bob"}  # the file bounds the names
        (ns_stats,) = server.node.store.stats().namespaces
        assert set(ns_stats.tenants) == {"alice", "bob"}
    finally:
        await server.stop(0.1)


async def test_tenants_holding_blocks_fold_too(server_config: Config):
    server = Server(replace(server_config, max_tenant_labels=5), clock=ManualClock())
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            ns = (
                await stub.RegisterNamespace(
                    pb.RegisterNamespaceRequest(model_id="m", layout=LAYOUT), timeout=5
                )
            ).namespace_id
            for i in range(20):  # 20 tenants, one resident block each (capacity 64)
                md = tenant(i)
                lid = (await stub.OpenLease(pb.OpenLeaseRequest(), metadata=md)).lease_id
                res = await stub.Reserve(
                    pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=list(range(4))),
                    metadata=md,
                )
                await stub.Commit(
                    pb.CommitRequest(
                        namespace_id=ns,
                        lease_id=lid,
                        packed_hashes=b"".join([entries_of(res)[0].hash]),
                        packed_checksums=stand_in_checksums(b"".join([entries_of(res)[0].hash])),
                    ),
                    metadata=md,
                )
            (ns_stats,) = (await stub.Stats(pb.StatsRequest(), timeout=5)).namespaces
        rows = {t.tenant: t for t in ns_stats.tenants}
        assert len(rows) == 6 and rows[OTHER_TENANTS].resident_blocks == 15
        assert sum(t.resident_blocks for t in rows.values()) == 20
        assert sum(t.stored_blocks for t in rows.values()) == 20
    finally:
        await server.stop(0.1)


def test_counter_book_keeps_the_first_tenants_and_folds_the_rest():
    book = TenantCounterBook(limit=2)
    for name in ("a", "b", "c", "d", "a", "c"):
        book.of(TenantId(name)).lookups += 1
    counts = {t: c.lookups for t, c in book.copies().items()}
    assert counts == {"a": 2, "b": 1, OTHER_TENANTS: 3} and len(book) == 3
    resident = {TenantId("a"): 1, TenantId("c"): 2, TenantId("d"): 4, SHARED_SCOPE: 5}
    assert book.fold(resident) == {"a": 1, OTHER_TENANTS: 6, SHARED_SCOPE: 5}
    assert TenantCounterBook(limit=0).fold(resident) == resident
