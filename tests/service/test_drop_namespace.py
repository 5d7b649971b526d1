"""DropNamespace: a namespace, its blocks and its pool go; its memory returns to the budget."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from tests.inproc import BLOCK_BYTES, BLOCK_SIZE, LAYOUT
from tests.replies import entries_of


def exists(path: str) -> bool:
    return Path(path).exists()  # a stat on tmpfs: no real blocking


TOKENS = list(range(500, 500 + 3 * BLOCK_SIZE))


async def store(stub, ns: str, lid: int, tokens: list[int]) -> list[bytes]:
    """Reserve, write and commit the blocks of ``tokens``; their hashes."""
    res = await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=tokens))
    hashes = [e.hash for e in entries_of(res)]
    assert all(e.status == pb.RESERVE_STATUS_RESERVED for e in entries_of(res))

    async def writes():
        yield pb.WriteBlocksRequest(
            header=pb.WriteBlocksHeader(namespace_id=ns, lease_id=lid, commit=True)
        )
        for i, h in enumerate(hashes):
            yield pb.WriteBlocksRequest(
                block=pb.BlockData(hash=h, data=bytes([i + 7]) * BLOCK_BYTES)
            )

    assert (await stub.WriteBlocks(writes())).committed == len(hashes)
    return hashes


async def test_drop_refused_while_pinned_then_forced(stub, namespace, server_config):
    ns = namespace.id
    lid = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=60))).lease_id
    hashes = await store(stub, ns, lid, TOKENS)
    pool = await stub.AttachPool(pb.AttachPoolRequest(namespace_id=ns))
    assert all(exists(a.path) for a in pool.arenas)
    before = await stub.Stats(pb.StatsRequest())
    assert before.allocated_bytes == namespace.capacity * BLOCK_BYTES
    await stub.Lookup(
        pb.LookupRequest(namespace_id=ns, lease_id=lid, pin=True, packed_hashes=b"".join(hashes))
    )

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.DropNamespace(pb.DropNamespaceRequest(namespace_id=ns))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "3 pinned" in err.value.details() and "force" in err.value.details()
    assert len((await stub.Stats(pb.StatsRequest())).namespaces) == 1  # nothing changed

    watch = stub.WatchEvents(pb.WatchEventsRequest(namespace_id=ns))
    await watch.initial_metadata()
    dropped = await stub.DropNamespace(pb.DropNamespaceRequest(namespace_id=ns, force=True))
    assert dropped.removed == 3 and dropped.pins_dropped == 3 and dropped.writes_aborted == 0
    assert dropped.freed_bytes == namespace.capacity * BLOCK_BYTES
    removed = await asyncio.wait_for(watch.read(), 5)
    cleared = await asyncio.wait_for(watch.read(), 5)
    watch.cancel()
    assert removed.kind == pb.EVENT_KIND_REMOVED and set(removed.hashes) == set(hashes)
    assert cleared.kind == pb.EVENT_KIND_CLEARED

    after = await stub.Stats(pb.StatsRequest())
    assert after.namespaces == [] and after.allocated_bytes == 0 and after.pinned == 0
    assert not any(exists(a.path) for a in pool.arenas)  # files unlinked
    for call, req in (
        (stub.ListBlocks, pb.ListBlocksRequest(namespace_id=ns)),
        (stub.AttachPool, pb.AttachPoolRequest(namespace_id=ns)),
        (stub.Lookup, pb.LookupRequest(namespace_id=ns, packed_hashes=b"".join(hashes))),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(req)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # The lease lived on: only its pins in the dropped namespace went.
    assert (await stub.KeepAlive(pb.KeepAliveRequest(lease_id=lid))).ttl_seconds > 0
    assert (await stub.CloseLease(pb.CloseLeaseRequest(lease_id=lid))).pins_released == 0


async def test_drop_forced_aborts_writes_and_the_layout_registers_again(stub, namespace):
    ns = namespace.id
    lid = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=60))).lease_id
    await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=TOKENS))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.DropNamespace(pb.DropNamespaceRequest(namespace_id=ns))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "3 WRITING" in err.value.details()
    dropped = await stub.DropNamespace(pb.DropNamespaceRequest(namespace_id=ns, force=True))
    assert dropped.writes_aborted == 3 and dropped.removed == 3

    again = await stub.RegisterNamespace(
        pb.RegisterNamespaceRequest(model_id="test-model", layout=LAYOUT)
    )
    assert again.created and again.namespace_id == ns
    hashes = await store(stub, ns, lid, TOKENS)  # the old lease writes into the new pool
    hit = await stub.Lookup(pb.LookupRequest(namespace_id=ns, packed_hashes=b"".join(hashes)))
    assert hit.hit_blocks == 3


async def test_drop_without_pins_needs_no_force_and_unknown_is_not_found(stub, namespace):
    lid = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=60))).lease_id
    await store(stub, namespace.id, lid, TOKENS)
    dropped = await stub.DropNamespace(pb.DropNamespaceRequest(namespace_id=namespace.id))
    assert dropped.removed == 3 and dropped.pins_dropped == 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.DropNamespace(pb.DropNamespaceRequest(namespace_id=namespace.id))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.DropNamespace(pb.DropNamespaceRequest(namespace_id="not a namespace!"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
