"""Isolation between tenants over gRPC, quotas, and the request/resource limits."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.server import Server
from tests.inproc import ManualClock
from tests.replies import entries_of
from tests.stand_ins import stand_in_checksums
from tests.tenants import ALICE_TOKEN, BOB_TOKEN, bearer, open_lease, register, store


async def test_identical_prompts_never_share_and_foreign_prefix_is_a_plain_miss(auth_stub):
    alice_ns = await register(auth_stub, ALICE_TOKEN)
    bob_ns = await register(auth_stub, BOB_TOKEN)
    assert alice_ns.chain_root != bob_ns.chain_root  # salts chosen by the server per tenant
    ns = alice_ns.namespace_id
    prompt = list(range(12))
    alice_chain = await store(
        auth_stub, ALICE_TOKEN, ns, await open_lease(auth_stub, ALICE_TOKEN), prompt
    )
    meta = bearer(BOB_TOKEN)
    for fields in ({"tokens": prompt}, {"packed_hashes": b"".join(alice_chain)}):
        cached = await auth_stub.Lookup(pb.LookupRequest(namespace_id=ns, **fields), metadata=meta)
        fresh_fields = (
            {"tokens": list(range(500, 512))}
            if "tokens" in fields
            else {"packed_hashes": bytes([9]) * 32 * 3}
        )
        never = await auth_stub.Lookup(
            pb.LookupRequest(namespace_id=ns, **fresh_fields), metadata=meta
        )
        cached.ClearField("packed_chain")
        never.ClearField("packed_chain")
        assert cached == never  # every field, miss_reason included
    bob_lease = await open_lease(auth_stub, BOB_TOKEN)
    resp = await auth_stub.Reserve(
        pb.ReserveRequest(namespace_id=ns, lease_id=bob_lease, packed_hashes=b"".join(alice_chain)),
        metadata=meta,
    )
    assert [e.status for e in entries_of(resp)] == [pb.RESERVE_STATUS_RESERVED] * 3
    assert {e.location.slot for e in entries_of(resp)}.isdisjoint(
        {
            b.slot
            for b in (
                await auth_stub.ListBlocks(
                    pb.ListBlocksRequest(namespace_id=ns), metadata=bearer(ALICE_TOKEN)
                )
            ).blocks
        }
    )


async def test_quota_from_the_tenants_file(auth_stub):
    ns = (await register(auth_stub, ALICE_TOKEN)).namespace_id  # alice: max_blocks = 6
    lease = await open_lease(auth_stub, ALICE_TOKEN)
    await store(auth_stub, ALICE_TOKEN, ns, lease, list(range(4 * 6)))
    resp = await auth_stub.Reserve(
        pb.ReserveRequest(namespace_id=ns, lease_id=lease, tokens=list(range(1000, 1004))),
        metadata=bearer(ALICE_TOKEN),
    )
    assert entries_of(resp)[0].status == pb.RESERVE_STATUS_RESERVED  # evicted one of her own
    stats = await auth_stub.Stats(pb.StatsRequest(), metadata=bearer(ALICE_TOKEN))
    assert stats.namespaces[0].tenants[0].resident_blocks == 6


async def test_leases_per_tenant_bound(auth_stub):
    await open_lease(auth_stub, ALICE_TOKEN)
    await open_lease(auth_stub, ALICE_TOKEN)  # alice: max_leases = 2
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await open_lease(auth_stub, ALICE_TOKEN)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "already holds 2 leases" in err.value.details()
    await open_lease(auth_stub, BOB_TOKEN)  # others unaffected


async def limited(config, **changes):
    server = Server(replace(config, **changes), clock=ManualClock(), expiry_tick=0.02)
    await server.start()
    return server


async def test_pins_per_lease_bound(server_config):
    server = await limited(server_config, max_pins_per_lease=2)
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = kvstore_pb2_grpc.KVStoreStub(ch)
            from tests.inproc import LAYOUT

            ns = (
                await stub.RegisterNamespace(
                    pb.RegisterNamespaceRequest(model_id="m", layout=LAYOUT)
                )
            ).namespace_id
            lease = (await stub.OpenLease(pb.OpenLeaseRequest())).lease_id
            resp = await stub.Reserve(
                pb.ReserveRequest(namespace_id=ns, lease_id=lease, tokens=list(range(12)))
            )
            await stub.Commit(
                pb.CommitRequest(
                    namespace_id=ns,
                    lease_id=lease,
                    packed_hashes=b"".join([e.hash for e in entries_of(resp)]),
                    packed_checksums=stand_in_checksums(
                        b"".join([e.hash for e in entries_of(resp)])
                    ),
                )
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Lookup(
                    pb.LookupRequest(
                        namespace_id=ns, lease_id=lease, pin=True, tokens=list(range(12))
                    )
                )
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "over the limit of 2" in err.value.details()
    finally:
        await server.stop(0.1)


async def test_request_size_bounds(server_config):
    server = await limited(server_config, max_chain_blocks=4, max_message_bytes=64 << 10)
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = kvstore_pb2_grpc.KVStoreStub(ch)
            from tests.inproc import LAYOUT

            ns = (
                await stub.RegisterNamespace(
                    pb.RegisterNamespaceRequest(model_id="m", layout=LAYOUT)
                )
            ).namespace_id
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Lookup(
                    pb.LookupRequest(namespace_id=ns, packed_hashes=b"".join([bytes(32)] * 5))
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 4" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Ping(pb.PingRequest(payload=bytes(128 << 10)))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await server.stop(0.1)


async def test_concurrent_rpc_bound(server_config):
    server = await limited(server_config, max_concurrent_rpcs=1)
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = kvstore_pb2_grpc.KVStoreStub(ch)
            watch = stub.WatchEvents(pb.WatchEventsRequest())  # holds the one slot
            await watch.initial_metadata()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Ping(pb.PingRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "Concurrent RPC limit exceeded" in err.value.details()
            watch.cancel()
            await asyncio.sleep(0.05)
    finally:
        await server.stop(0.1)
