"""Bad input for every RPC: the right status code, a message that says what was
wrong, and a server that keeps serving afterwards."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvstore.v1 import kvstore_pb2 as pb
from tests.inproc import BLOCK_BYTES, BLOCK_SIZE, LAYOUT, tenant
from tests.replies import blocks_of, entries_of
from tests.service.calls import INVALID, expect
from tests.stand_ins import stand_in_checksums

NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
UNKNOWN_NS = "0123456789abcdef"
H = b"\x01" * 32


@pytest.fixture
async def lease(stub) -> int:
    return (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=10))).lease_id


def layout(**changes) -> pb.KVLayout:
    msg = pb.KVLayout()
    msg.CopyFrom(LAYOUT)
    for key, value in changes.items():
        setattr(msg, key, value)
    return msg


async def test_leases(stub, lease, clock):
    await expect(stub, INVALID, "ttl_seconds", stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=-1)))
    await expect(stub, INVALID, "3600", stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=1e6)))
    await expect(stub, INVALID, "lease_id", stub.KeepAlive(pb.KeepAliveRequest()))
    await expect(stub, NOT_FOUND, "no lease", stub.KeepAlive(pb.KeepAliveRequest(lease_id=12345)))
    await expect(stub, NOT_FOUND, "no lease", stub.CloseLease(pb.CloseLeaseRequest(lease_id=7)))
    # Another tenant's lease looks unknown: lease ids are not shared across tenants.
    await expect(
        stub,
        NOT_FOUND,
        "no lease",
        stub.KeepAlive(pb.KeepAliveRequest(lease_id=lease), metadata=tenant("other")),
    )
    clock.advance(11)
    await expect(stub, PRECONDITION, "expired", stub.KeepAlive(pb.KeepAliveRequest(lease_id=lease)))
    await expect(
        stub, PRECONDITION, "expired", stub.CloseLease(pb.CloseLeaseRequest(lease_id=lease))
    )


async def test_register_namespace(stub):
    def reg(**kw):
        kw.setdefault("model_id", "m")
        kw.setdefault("layout", LAYOUT)
        return stub.RegisterNamespace(pb.RegisterNamespaceRequest(**kw))

    await expect(stub, INVALID, "model_id", reg(model_id=""))
    await expect(stub, INVALID, "layout", reg(layout=pb.KVLayout()))
    await expect(stub, INVALID, "num_layers", reg(layout=layout(num_layers=0)))
    await expect(stub, INVALID, "dtype", reg(layout=layout(dtype="float64")))
    await expect(stub, INVALID, "kv_order", reg(layout=layout(kv_order="sideways")))
    await expect(stub, INVALID, "scheme", reg(scheme=99))
    await expect(stub, INVALID, "vllm_seed", reg(scheme=pb.HASH_SCHEME_VLLM_SHA256_CBOR))
    await expect(stub, INVALID, "vllm_seed", reg(vllm_seed="0"))
    await expect(stub, INVALID, "1 GiB", reg(layout=layout(num_layers=1 << 20, head_dim=1 << 10)))
    # A pool starts with one arena (16 blocks here) and grows on demand; a full
    # budget is RESOURCE_EXHAUSTED (tests/service/test_namespace_budget.py).
    first = await reg(model_id="big", capacity_bytes=1 << 30)
    assert first.capacity_blocks == 16


async def test_attach_pool(stub):
    await expect(stub, INVALID, "namespace_id", stub.AttachPool(pb.AttachPoolRequest()))
    await expect(
        stub, INVALID, "not a namespace id", stub.AttachPool(pb.AttachPoolRequest(namespace_id="x"))
    )
    await expect(
        stub,
        NOT_FOUND,
        "not registered",
        stub.AttachPool(pb.AttachPoolRequest(namespace_id=UNKNOWN_NS)),
    )


async def test_lookup(stub, namespace, lease, clock):
    ns = namespace.id

    def look(metadata=None, **kw):
        kw.setdefault("namespace_id", ns)
        return stub.Lookup(pb.LookupRequest(**kw), metadata=metadata)

    err = await expect(stub, INVALID, "32-byte hashes", look(packed_hashes=b"short"))
    status = rpc_status.from_call(err)
    assert status is not None
    detail = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(detail)
    assert detail.field_violations[0].field == "packed_hashes"
    await expect(stub, INVALID, "not both", look(tokens=[1, 2, 3, 4], packed_hashes=H))
    await expect(stub, INVALID, "both are empty", look())
    await expect(stub, INVALID, "extras", look(packed_hashes=H, extras=[b"lora"]))
    await expect(stub, INVALID, "pin=true", look(pin=True, packed_hashes=H))
    await expect(stub, INVALID, "extras", look(tokens=list(range(8)), extras=[b"one"]))
    await expect(stub, NOT_FOUND, "not registered", look(namespace_id=UNKNOWN_NS, packed_hashes=H))
    await expect(stub, INVALID, "namespace_id", look(namespace_id="", packed_hashes=H))
    await expect(stub, NOT_FOUND, "no lease", look(pin=True, lease_id=99, packed_hashes=H))
    # Bounded: at most max_chain_blocks (256) blocks, in hashes or in tokens.
    await expect(stub, INVALID, "at most 256", look(packed_hashes=H * 257))
    await expect(stub, INVALID, "max_chain_blocks", look(tokens=[1] * (257 * BLOCK_SIZE)))
    # Over the message size limit (1 MiB): gRPC itself refuses it.
    await expect(stub, EXHAUSTED, "", look(tokens=[1 << 31] * 300_000))
    await expect(stub, INVALID, "tenant", look(packed_hashes=H, metadata=tenant("bad tenant!")))
    clock.advance(11)
    await expect(stub, PRECONDITION, "expired", look(pin=True, lease_id=lease, packed_hashes=H))


async def test_reserve_commit_abort_release(stub, namespace, lease, clock):
    ns = namespace.id
    await expect(
        stub,
        INVALID,
        "lease_id",
        stub.Reserve(pb.ReserveRequest(namespace_id=ns, packed_hashes=H)),
    )
    await expect(
        stub,
        NOT_FOUND,
        "no lease",
        stub.Reserve(
            pb.ReserveRequest(namespace_id=ns, lease_id=lease, packed_hashes=H),
            metadata=tenant("b"),
        ),
    )
    await expect(
        stub,
        INVALID,
        "32-byte hashes",
        stub.Reserve(
            pb.ReserveRequest(namespace_id=ns, lease_id=lease, packed_hashes=b"".join([b"x" * 33]))
        ),
    )
    for rpc, req in (
        (stub.Commit, pb.CommitRequest),
        (stub.Abort, pb.AbortRequest),
        (stub.Release, pb.ReleaseRequest),
    ):
        await expect(stub, INVALID, "empty", rpc(req(namespace_id=ns, lease_id=lease)))
        await expect(
            stub,
            INVALID,
            "32-byte hashes",
            rpc(req(namespace_id=ns, lease_id=lease, packed_hashes=b"1")),
        )
        await expect(stub, INVALID, "lease_id", rpc(req(namespace_id=ns, packed_hashes=H)))
        await expect(
            stub,
            NOT_FOUND,
            "not registered",
            rpc(req(namespace_id=UNKNOWN_NS, lease_id=lease, packed_hashes=H)),
        )
        await expect(
            stub,
            INVALID,
            "at most",
            rpc(req(namespace_id=ns, lease_id=lease, packed_hashes=H * 300)),
        )
    await expect(
        stub,
        PRECONDITION,
        "not being written",
        stub.Commit(
            pb.CommitRequest(
                namespace_id=ns,
                lease_id=lease,
                packed_hashes=H,
                packed_checksums=stand_in_checksums(H),
            )
        ),
    )
    clock.advance(11)
    await expect(
        stub,
        PRECONDITION,
        "expired",
        stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lease, packed_hashes=H)),
    )


async def test_read_blocks(stub, namespace, lease):
    ns = namespace.id
    res = await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lease, packed_hashes=H))
    loc = entries_of(res)[0].location
    await stub.Commit(
        pb.CommitRequest(
            namespace_id=ns, lease_id=lease, packed_hashes=H, packed_checksums=stand_in_checksums(H)
        )
    )
    # A commit stamps the slot with a new (READY) generation: the one Lookup answers.
    ready = blocks_of(await stub.Lookup(pb.LookupRequest(namespace_id=ns, packed_hashes=H)))[0]
    assert ready.slot == loc.slot and ready.generation != loc.generation
    ref = pb.BlockRef(hash=H, slot=loc.slot, generation=ready.generation)

    def read(**kw):
        kw.setdefault("namespace_id", ns)
        kw.setdefault("lease_id", lease)
        return stub.ReadBlocks(pb.ReadBlocksRequest(**kw))

    await expect(stub, INVALID, "empty", read())
    await expect(stub, INVALID, "lease_id", read(lease_id=0, blocks=[ref]))
    await expect(stub, INVALID, "32 bytes", read(blocks=[pb.BlockRef(hash=b"1")]))
    await expect(stub, PRECONDITION, "not pinned", read(blocks=[ref]))
    stale = pb.BlockRef(hash=H, slot=loc.slot, generation=ready.generation + 1)
    await expect(stub, PRECONDITION, "no longer holds", read(blocks=[stale]))
    await expect(stub, NOT_FOUND, "not registered", read(namespace_id=UNKNOWN_NS, blocks=[ref]))
    await expect(stub, INVALID, "at most 256", read(blocks=[ref] * 300))


async def test_write_blocks(stub, namespace, lease):
    ns = namespace.id
    header = pb.WriteBlocksRequest(header=pb.WriteBlocksHeader(namespace_id=ns, lease_id=lease))

    def block(hash_=H, size=BLOCK_BYTES):
        return pb.WriteBlocksRequest(block=pb.BlockData(hash=hash_, data=b"\0" * size))

    await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lease, packed_hashes=H))
    await expect(stub, INVALID, "header", stub.WriteBlocks(iter([])))
    await expect(stub, INVALID, "header", stub.WriteBlocks(iter([block()])))
    await expect(stub, INVALID, "only the first", stub.WriteBlocks(iter([header, header])))
    await expect(
        stub,
        INVALID,
        f"{BLOCK_BYTES} bytes, got 3",
        stub.WriteBlocks(iter([header, block(size=3)])),
    )
    await expect(stub, INVALID, "32 bytes", stub.WriteBlocks(iter([header, block(hash_=b"1")])))
    await expect(
        stub, PRECONDITION, "not reserved", stub.WriteBlocks(iter([header, block(b"\2" * 32)]))
    )
    foreign = pb.WriteBlocksRequest(header=pb.WriteBlocksHeader(namespace_id=ns, lease_id=lease))
    await expect(
        stub,
        NOT_FOUND,
        "no lease",
        stub.WriteBlocks(iter([foreign, block()]), metadata=tenant("b")),
    )
    no_lease = pb.WriteBlocksRequest(header=pb.WriteBlocksHeader(namespace_id=ns))
    await expect(stub, INVALID, "lease_id", stub.WriteBlocks(iter([no_lease, block()])))
    # After all those failures the reservation still works.
    ok = await stub.WriteBlocks(iter([header, block()]))
    assert ok.written == 1


async def test_inspection_and_admin(stub, namespace):
    ns = namespace.id
    await expect(
        stub,
        INVALID,
        "1000",
        stub.ListBlocks(pb.ListBlocksRequest(namespace_id=ns, page_size=1001)),
    )
    await expect(
        stub,
        INVALID,
        "page_token",
        stub.ListBlocks(pb.ListBlocksRequest(namespace_id=ns, page_token="garbage")),
    )
    await expect(stub, INVALID, "namespace_id", stub.ListBlocks(pb.ListBlocksRequest()))
    await expect(stub, PRECONDITION, "redis", stub.WatchEvents(pb.WatchEventsRequest(cluster=True)))
    await expect(
        stub,
        NOT_FOUND,
        "not registered",
        stub.WatchEvents(pb.WatchEventsRequest(namespace_id=UNKNOWN_NS)),
    )
    await expect(stub, INVALID, "tenant", stub.Stats(pb.StatsRequest(), metadata=tenant("")))
    await expect(stub, INVALID, "blocks", stub.Evict(pb.EvictRequest(namespace_id=ns)))
    await expect(
        stub,
        NOT_FOUND,
        "not registered",
        stub.Evict(pb.EvictRequest(namespace_id=UNKNOWN_NS, blocks=1)),
    )
    await expect(
        stub, NOT_FOUND, "not registered", stub.Clear(pb.ClearRequest(namespace_id=UNKNOWN_NS))
    )
    await expect(stub, EXHAUSTED, "", stub.Ping(pb.PingRequest(payload=b"x" * (2 << 20))))


async def test_a_bug_is_internal_not_unknown(stub, kv_server, monkeypatch):
    def broken():
        raise KeyError("oops")

    monkeypatch.setattr(kv_server.node.store, "stats", broken)
    await expect(stub, grpc.StatusCode.INTERNAL, "internal error", stub.Stats(pb.StatsRequest()))
