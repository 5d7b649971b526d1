"""Auth on: tokens map to tenants, namespaces are checked, admin and peer verbs need tokens."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.server import Server
from service.tenancy.tenants import TenantDirectory, TenantsFileError
from tests.inproc import ManualClock
from tests.stand_ins import stand_in_checksums
from tests.tenants import (
    ADMIN_TOKEN,
    ALICE_TOKEN,
    BOB_TOKEN,
    MODEL,
    OTHER_MODEL,
    bearer,
    open_lease,
    register,
    store,
)


async def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


async def test_no_token_or_unknown_token_is_unauthenticated(auth_stub):
    assert await code_of(auth_stub.OpenLease(pb.OpenLeaseRequest(), timeout=5)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    # The tenant header alone counts for nothing when auth is on.
    call = auth_stub.OpenLease(pb.OpenLeaseRequest(), metadata=(("x-kvstore-tenant", "bob"),))
    assert await code_of(call) == grpc.StatusCode.UNAUTHENTICATED
    call = auth_stub.Stats(pb.StatsRequest(), metadata=bearer("not-a-token-of-anyone"))
    assert await code_of(call) == grpc.StatusCode.UNAUTHENTICATED


async def test_tenant_comes_from_the_token_not_the_header(auth_stub):
    ns = (await register(auth_stub, ALICE_TOKEN)).namespace_id
    lease = await open_lease(auth_stub, ALICE_TOKEN)
    chain = await store(auth_stub, ALICE_TOKEN, ns, lease, list(range(8)))
    # Bob claims to be alice in the header: still bob, still a miss.
    meta = (*bearer(BOB_TOKEN), ("x-kvstore-tenant", "alice"))
    resp = await auth_stub.Lookup(
        pb.LookupRequest(namespace_id=ns, packed_hashes=b"".join(chain)), metadata=meta
    )
    assert resp.hit_blocks == 0
    resp = await auth_stub.Lookup(
        pb.LookupRequest(namespace_id=ns, packed_hashes=b"".join(chain)),
        metadata=bearer(ALICE_TOKEN),
    )
    assert resp.hit_blocks == 2


async def test_namespace_permission(auth_stub):
    # alice may use MODEL only; bob may use any.
    call = register(auth_stub, ALICE_TOKEN, OTHER_MODEL)
    assert await code_of(call) == grpc.StatusCode.PERMISSION_DENIED
    other = (await register(auth_stub, BOB_TOKEN, OTHER_MODEL)).namespace_id
    lease = await open_lease(auth_stub, ALICE_TOKEN)
    meta = bearer(ALICE_TOKEN)
    calls = [
        auth_stub.AttachPool(pb.AttachPoolRequest(namespace_id=other), metadata=meta),
        auth_stub.Lookup(pb.LookupRequest(namespace_id=other, tokens=[1, 2, 3, 4]), metadata=meta),
        auth_stub.Reserve(
            pb.ReserveRequest(namespace_id=other, lease_id=lease, tokens=[1, 2, 3, 4]),
            metadata=meta,
        ),
        auth_stub.Commit(
            pb.CommitRequest(
                namespace_id=other,
                lease_id=lease,
                packed_hashes=b"".join([bytes(32)]),
                packed_checksums=stand_in_checksums(b"".join([bytes(32)])),
            ),
            metadata=meta,
        ),
        auth_stub.Abort(
            pb.AbortRequest(
                namespace_id=other, lease_id=lease, packed_hashes=b"".join([bytes(32)])
            ),
            metadata=meta,
        ),
        auth_stub.Release(
            pb.ReleaseRequest(
                namespace_id=other, lease_id=lease, packed_hashes=b"".join([bytes(32)])
            ),
            metadata=meta,
        ),
        auth_stub.ListBlocks(pb.ListBlocksRequest(namespace_id=other), metadata=meta),
    ]
    for call in calls:
        err = await code_of(call)
        assert err == grpc.StatusCode.PERMISSION_DENIED
    read = auth_stub.ReadBlocks(
        pb.ReadBlocksRequest(
            namespace_id=other, lease_id=lease, blocks=[pb.BlockRef(hash=bytes(32))]
        ),
        metadata=meta,
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in read:
            pass
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "may not use model" in err.value.details()


async def test_admin_verbs_need_the_admin_token_even_from_loopback(auth_stub):
    ns = (await register(auth_stub, BOB_TOKEN)).namespace_id
    request = pb.EvictRequest(namespace_id=ns, blocks=1)
    assert await code_of(auth_stub.Evict(request)) == grpc.StatusCode.UNAUTHENTICATED
    call = auth_stub.Evict(request, metadata=bearer(BOB_TOKEN))  # a tenant is no admin
    assert await code_of(call) == grpc.StatusCode.PERMISSION_DENIED
    resp = await auth_stub.Evict(request, metadata=bearer(ADMIN_TOKEN))
    assert resp.evicted == 0
    await auth_stub.Clear(pb.ClearRequest(namespace_id=ns), metadata=bearer(ADMIN_TOKEN))
    # The admin token names no tenant: no cache operations with it.
    call = auth_stub.OpenLease(pb.OpenLeaseRequest(), metadata=bearer(ADMIN_TOKEN))
    assert await code_of(call) == grpc.StatusCode.PERMISSION_DENIED


async def test_auth_on_without_admin_token_disables_admin_verbs(auth_config):
    config = replace(auth_config, admin_token="")
    async with (
        Server(config, clock=ManualClock()) as server,
        grpc.aio.insecure_channel(server.address) as ch,
    ):
        stub = kvstore_pb2_grpc.KVStoreStub(ch)
        ns = (await register(stub, BOB_TOKEN)).namespace_id
        call = stub.Evict(pb.EvictRequest(namespace_id=ns, blocks=1), metadata=bearer(BOB_TOKEN))
        assert await code_of(call) == grpc.StatusCode.PERMISSION_DENIED


async def test_fetch_blocks_needs_the_cluster_token_when_auth_is_on(auth_stub):
    ns = (await register(auth_stub, ALICE_TOKEN)).namespace_id
    lease = await open_lease(auth_stub, ALICE_TOKEN)
    chain = await store(auth_stub, ALICE_TOKEN, ns, lease, list(range(8)))
    request = pb.FetchBlocksRequest(namespace_id=ns, tenant="alice", hashes=chain)
    for meta in ((), bearer(BOB_TOKEN), bearer(ADMIN_TOKEN)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in auth_stub.FetchBlocks(request, metadata=meta):
                pass
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "cluster_token" in err.value.details()


async def test_inspection_is_confined_to_the_callers_tenant(auth_stub):
    ns = (await register(auth_stub, ALICE_TOKEN)).namespace_id
    await register(auth_stub, BOB_TOKEN, OTHER_MODEL)
    for token, start in ((ALICE_TOKEN, 0), (BOB_TOKEN, 100)):
        lease = await open_lease(auth_stub, token)
        await store(auth_stub, token, ns, lease, list(range(start, start + 8)))
    listed = await auth_stub.ListBlocks(
        pb.ListBlocksRequest(namespace_id=ns), metadata=bearer(BOB_TOKEN)
    )
    assert listed.total == 2 and {b.tenant for b in listed.blocks} == {"bob"}
    every = await auth_stub.ListBlocks(
        pb.ListBlocksRequest(namespace_id=ns), metadata=bearer(ADMIN_TOKEN)
    )
    assert every.total == 4
    stats = await auth_stub.Stats(pb.StatsRequest(), metadata=bearer(ALICE_TOKEN))
    assert [n.model_id for n in stats.namespaces] == [MODEL]  # not bob's other model
    assert {t.tenant for t in stats.namespaces[0].tenants} == {"alice"}
    admin = await auth_stub.Stats(pb.StatsRequest(), metadata=bearer(ADMIN_TOKEN))
    assert {t.tenant for n in admin.namespaces for t in n.tenants} == {"alice", "bob"}


async def test_watch_events_shows_only_the_callers_scope(auth_stub):
    ns = (await register(auth_stub, ALICE_TOKEN)).namespace_id
    watch = auth_stub.WatchEvents(
        pb.WatchEventsRequest(namespace_id=ns), metadata=bearer(ALICE_TOKEN)
    )
    await watch.initial_metadata()
    bob_lease = await open_lease(auth_stub, BOB_TOKEN)
    await store(auth_stub, BOB_TOKEN, ns, bob_lease, list(range(8)))
    alice_lease = await open_lease(auth_stub, ALICE_TOKEN)
    mine = await store(auth_stub, ALICE_TOKEN, ns, alice_lease, list(range(8)))
    event = await watch.read()
    assert event.tenant == "alice" and list(event.hashes) == mine  # bob's came first, unseen
    watch.cancel()


def test_tenants_file_is_checked():
    with pytest.raises(TenantsFileError, match="at least 16"):
        TenantDirectory.parse({"tenants": {"a": {"tokens": ["short"], "namespaces": ["*"]}}})
    with pytest.raises(TenantsFileError, match="also"):
        TenantDirectory.parse(
            {
                "tenants": {
                    "a": {"tokens": ["x" * 16], "namespaces": ["*"]},
                    "b": {"tokens": ["x" * 16], "namespaces": ["*"]},
                }
            }
        )
    with pytest.raises(TenantsFileError, match="unknown keys"):
        TenantDirectory.parse({"tenants": {"a": {"tokens": ["x" * 16], "salt": "s"}}})
    directory = TenantDirectory.parse(
        {"tenants": {"a": {"tokens": ["x" * 16], "namespaces": ["m"], "max_blocks": 3}}}
    )
    policy = directory.authenticate("x" * 16)
    assert policy is not None and policy.may_use("m") and not policy.may_use("n")
    assert directory.authenticate("x" * 15) is None
