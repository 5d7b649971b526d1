"""Metrics an operator charts: sub-millisecond RPC buckets, model names, cancelled watches."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.config import Config
from service.server import Server
from tests.service.conftest import LAYOUT, ManualClock, server_config  # noqa: F401


@pytest.fixture
async def node(server_config: Config) -> AsyncIterator[Server]:  # noqa: F811
    server = Server(server_config, clock=ManualClock(), expiry_tick=0.02)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0.1)


@pytest.fixture
async def stub(node: Server) -> AsyncIterator[kvstore_pb2_grpc.KVStoreStub]:
    async with grpc.aio.insecure_channel(node.address) as channel:
        yield kvstore_pb2_grpc.KVStoreStub(channel)


async def test_rpc_buckets_resolve_sub_millisecond_lookups(node, stub):
    ns = (
        await stub.RegisterNamespace(pb.RegisterNamespaceRequest(model_id="m", layout=LAYOUT))
    ).namespace_id
    for _ in range(20):
        await stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=list(range(8))))
    registry = node.node.metrics.registry

    def bucket(le: str) -> float:
        value = registry.get_sample_value(
            "kvstore_rpc_duration_seconds_bucket", {"method": "Lookup", "le": le}
        )
        assert value is not None, le
        return value

    bounds = sorted(
        float(s.labels["le"])
        for metric in registry.collect()
        if metric.name == "kvstore_rpc_duration_seconds"
        for s in metric.samples
        if s.name.endswith("_bucket") and s.labels["method"] == "Lookup"
    )
    assert bounds[0] <= 0.0001 and 0.0005 in bounds and 0.001 in bounds
    # Every lookup took more than the smallest bucket and (generously) less than 100 ms.
    assert bucket("5e-05") < 20 and bucket("0.1") == 20


async def test_namespace_info_names_the_model(node, stub):
    resp = await stub.RegisterNamespace(
        pb.RegisterNamespaceRequest(model_id="meta-llama/Llama-3.1-8B", layout=LAYOUT)
    )
    text = node.node.metrics.render().decode()
    lines = [x for x in text.splitlines() if x.startswith("kvstore_namespace_info{")]
    assert len(lines) == 1, text
    line = lines[0]
    assert f'namespace="{resp.namespace_id}"' in line
    assert 'model="meta-llama/Llama-3.1-8B"' in line and line.endswith(" 1.0")


async def test_a_cancelled_watch_is_not_an_error(node, stub, caplog):
    caplog.set_level(logging.DEBUG)
    registry = node.node.metrics.registry
    hub = node.node.events
    for _ in range(3):
        call = stub.WatchEvents(pb.WatchEventsRequest())
        await call.initial_metadata()  # subscribed
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
    deadline = asyncio.get_running_loop().time() + 10
    while registry.get_sample_value(
        "kvstore_rpc_cancelled_total", {"method": "WatchEvents"}
    ) != 3 or len(hub):
        assert asyncio.get_running_loop().time() < deadline, "the watches never ended"
        await asyncio.sleep(0.02)
    errors = [
        s
        for metric in registry.collect()
        if metric.name == "kvstore_rpc_errors"
        for s in metric.samples
        if s.name == "kvstore_rpc_errors_total" and s.labels["method"] == "WatchEvents"
    ]
    assert errors == []
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING], [
        r.getMessage() for r in caplog.records
    ]
