"""Prometheus metrics: counters per namespace and tenant, gauges at scrape, HTTP."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from tests.inproc import BLOCK_SIZE
from tests.stand_ins import stand_in_checksums


async def test_lookup_and_occupancy_metrics(stub, namespace, kv_server):
    ns = namespace.id
    tokens = list(range(2 * BLOCK_SIZE + 1))
    await stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=tokens))
    lid = (await stub.OpenLease(pb.OpenLeaseRequest())).lease_id
    await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=tokens))
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.Commit(
            pb.CommitRequest(
                namespace_id=ns,
                lease_id=lid,
                packed_hashes=b"".join([b"\0" * 32]),
                packed_checksums=stand_in_checksums(b"".join([b"\0" * 32])),
            )
        )
    registry = kv_server.node.metrics.registry

    def value(name, **labels):
        return registry.get_sample_value(name, labels)

    who = {"namespace": ns, "tenant": "default"}
    assert value("kvstore_lookup_tokens_total", **who, result="miss") == 9
    assert value("kvstore_lookup_tokens_total", **who, result="hit") == 0
    assert value("kvstore_lookup_blocks_total", **who, result="miss") == 2
    assert value("kvstore_blocks", namespace=ns, state="writing") == 2
    assert value("kvstore_blocks", namespace=ns, state="free") == namespace.capacity - 2
    assert value("kvstore_evictions_total", namespace=ns) == 0
    assert value("kvstore_leases") == 1
    assert value("kvstore_rpc_errors_total", method="Commit", code="FAILED_PRECONDITION") == 1
    assert value("kvstore_rpc_duration_seconds_count", method="Lookup") == 1
    assert value("kvstore_redis_connected") is None  # no Redis: no cluster metrics


async def test_http_endpoint_scrapes_from_another_thread(namespace, kv_server):
    metrics = kv_server.node.metrics
    port = metrics.start_http("127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    finally:
        metrics.stop_http()
    assert f'kvstore_blocks{{namespace="{namespace.id}",state="free"}}'.encode() in body
