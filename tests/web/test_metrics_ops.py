"""Metrics an operator charts: sub-millisecond RPC buckets, model names, cancelled watches."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvstore.v1 import kvstore_pb2 as pb

# The node and stub fixtures of the service tests (a Server on port 0, a manual clock).
from tests.inproc import LAYOUT
from tests.waiting import until


async def test_rpc_buckets_resolve_sub_millisecond_lookups(kv_server, stub):
    ns = (
        await stub.RegisterNamespace(pb.RegisterNamespaceRequest(model_id="m", layout=LAYOUT))
    ).namespace_id
    for _ in range(20):
        await stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=list(range(8))))
    registry = kv_server.node.metrics.registry

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


async def test_namespace_info_names_the_model(kv_server, stub):
    resp = await stub.RegisterNamespace(
        pb.RegisterNamespaceRequest(model_id="meta-llama/Llama-3.1-8B", layout=LAYOUT)
    )
    text = kv_server.node.metrics.render().decode()
    lines = [x for x in text.splitlines() if x.startswith("kvstore_namespace_info{")]
    assert len(lines) == 1, text
    line = lines[0]
    assert f'namespace="{resp.namespace_id}"' in line
    assert 'model="meta-llama/Llama-3.1-8B"' in line and line.endswith(" 1.0")


async def test_a_cancelled_watch_is_not_an_error(kv_server, stub, caplog):
    caplog.set_level(logging.DEBUG)
    registry = kv_server.node.metrics.registry
    hub = kv_server.node.events
    for _ in range(3):
        call = stub.WatchEvents(pb.WatchEventsRequest())
        await call.initial_metadata()  # subscribed
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
    await until(
        lambda: (
            registry.get_sample_value("kvstore_rpc_cancelled_total", {"method": "WatchEvents"}) == 3
            and not len(hub)
        ),
        interval=0.02,
        what="the watches to end",
    )
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
