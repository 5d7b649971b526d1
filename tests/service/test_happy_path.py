"""The whole block life cycle over the wire with raw stubs."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from tests.inproc import BLOCK_BYTES, BLOCK_SIZE, LAYOUT
from tests.replies import blocks_of, chain_of, entries_of
from tests.stand_ins import stand_in_checksums

TOKENS = list(range(100, 100 + 3 * BLOCK_SIZE + 2))  # 3 full blocks and a partial one


def block_data(i: int) -> bytes:
    return bytes([i + 1]) * BLOCK_BYTES


async def test_register_is_idempotent_and_conflicts_are_already_exists(stub):
    req = pb.RegisterNamespaceRequest(model_id="m", layout=LAYOUT)
    first = await stub.RegisterNamespace(req)
    again = await stub.RegisterNamespace(req)
    assert first.created and not again.created
    assert first.namespace_id == again.namespace_id
    assert first.block_bytes == BLOCK_BYTES and first.capacity_blocks == 16  # one arena
    assert len(first.chain_root) == 32 and first.layout.kv_order == "KV_LAYER_TOKEN_HEAD"
    other = pb.KVLayout()
    other.CopyFrom(LAYOUT)
    other.num_layers = 3
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RegisterNamespace(pb.RegisterNamespaceRequest(model_id="m", layout=other))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "registered with" in err.value.details()


async def test_attach_pool_describes_the_arenas(stub, namespace):
    resp = await stub.AttachPool(pb.AttachPoolRequest(namespace_id=namespace.id))
    assert resp.kind == "host" and resp.pool_epoch
    assert resp.capacity_blocks == namespace.capacity
    assert resp.slots_per_arena == 16 and len(resp.arenas) == 1  # grows on demand
    assert all(a.path for a in resp.arenas)


async def test_life_cycle(stub, namespace):
    ns = namespace.id
    watch = stub.WatchEvents(pb.WatchEventsRequest(namespace_id=ns))
    await watch.initial_metadata()  # the subscription is in place

    lease = await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=60, client_name="test"))
    assert lease.lease_id and lease.ttl_seconds == 60 and lease.node_id == "test-node"
    lid = lease.lease_id

    miss = await stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=TOKENS))
    assert miss.hit_blocks == 0 and miss.miss_reason == pb.MISS_REASON_ABSENT
    assert len(chain_of(miss)) == 3 and miss.query_tokens == len(TOKENS)
    assert miss.pool_epoch == lease.pool_epoch

    reserved = await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=TOKENS))
    assert [e.status for e in entries_of(reserved)] == [pb.RESERVE_STATUS_RESERVED] * 3
    assert [e.hash for e in entries_of(reserved)] == list(chain_of(miss))
    for e in entries_of(reserved):
        assert e.location.offset == (e.location.slot % 16) * BLOCK_BYTES

    async def writes():
        yield pb.WriteBlocksRequest(header=pb.WriteBlocksHeader(namespace_id=ns, lease_id=lid))
        for i, h in enumerate(chain_of(miss)):
            yield pb.WriteBlocksRequest(block=pb.BlockData(hash=h, data=block_data(i)))

    wrote = await stub.WriteBlocks(writes())
    assert wrote.written == 3 and wrote.committed == 0

    committed = await stub.Commit(
        pb.CommitRequest(
            namespace_id=ns,
            lease_id=lid,
            packed_hashes=b"".join(chain_of(miss)),
            packed_checksums=stand_in_checksums(b"".join(chain_of(miss))),
        )
    )
    assert committed.committed == 3

    event = await asyncio.wait_for(watch.read(), 5)
    assert event.kind == pb.EVENT_KIND_STORED and list(event.hashes) == list(chain_of(miss))
    assert event.namespace_id == ns and event.tenant == "default" and event.node_id == "test-node"
    watch.cancel()

    hit = await stub.Lookup(
        pb.LookupRequest(namespace_id=ns, lease_id=lid, pin=True, tokens=TOKENS)
    )
    assert hit.hit_blocks == 3 and hit.pinned and hit.hit_tokens == 3 * BLOCK_SIZE
    assert hit.miss_reason == pb.MISS_REASON_NONE
    by_hash = await stub.Lookup(
        pb.LookupRequest(namespace_id=ns, packed_hashes=b"".join(chain_of(hit)))
    )
    assert by_hash.hit_blocks == 3 and not by_hash.pinned and not chain_of(by_hash)

    refs = [pb.BlockRef(hash=b.hash, slot=b.slot, generation=b.generation) for b in blocks_of(hit)]
    read = stub.ReadBlocks(pb.ReadBlocksRequest(namespace_id=ns, lease_id=lid, blocks=refs))
    got = [m async for m in read]
    assert [m.data for m in got] == [block_data(i) for i in range(3)]

    stats = await stub.Stats(pb.StatsRequest())
    assert stats.leases == 1 and stats.pinned == 3 and stats.writing == 0
    (ns_stats,) = stats.namespaces
    assert ns_stats.ready == 3 and ns_stats.pinned == 3 and ns_stats.free == namespace.capacity - 3
    (tenant_stats,) = ns_stats.tenants
    assert tenant_stats.tenant == "default" and tenant_stats.stored_blocks == 3
    assert tenant_stats.hit_blocks == 6 and tenant_stats.miss_blocks == 3

    released = await stub.Release(
        pb.ReleaseRequest(namespace_id=ns, lease_id=lid, packed_hashes=b"".join(chain_of(hit)))
    )
    assert released.released == 3
    again = await stub.Release(
        pb.ReleaseRequest(namespace_id=ns, lease_id=lid, packed_hashes=b"".join(chain_of(hit)))
    )
    assert again.released == 0  # releasing twice never drives a count negative

    kept = await stub.KeepAlive(pb.KeepAliveRequest(lease_id=lid))
    assert 59 < kept.ttl_seconds <= 60

    await stub.Lookup(
        pb.LookupRequest(
            namespace_id=ns, lease_id=lid, pin=True, packed_hashes=b"".join(chain_of(hit))
        )
    )
    closed = await stub.CloseLease(pb.CloseLeaseRequest(lease_id=lid))
    assert closed.pins_released == 3 and closed.writes_aborted == 0
    stats = await stub.Stats(pb.StatsRequest())
    assert stats.leases == 0 and stats.namespaces[0].pinned == 0 and stats.namespaces[0].ready == 3


async def test_write_blocks_with_commit_and_abort(stub, namespace):
    ns = namespace.id
    lid = (await stub.OpenLease(pb.OpenLeaseRequest())).lease_id
    tokens = list(range(2 * BLOCK_SIZE))
    res = await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=tokens))
    first, second = (e.hash for e in entries_of(res))
    wrote = await stub.WriteBlocks(
        iter(
            [
                pb.WriteBlocksRequest(
                    header=pb.WriteBlocksHeader(namespace_id=ns, lease_id=lid, commit=True)
                ),
                pb.WriteBlocksRequest(block=pb.BlockData(hash=first, data=block_data(0))),
            ]
        )
    )
    assert wrote.written == 1 and wrote.committed == 1
    aborted = await stub.Abort(
        pb.AbortRequest(namespace_id=ns, lease_id=lid, packed_hashes=b"".join([second]))
    )
    assert aborted.aborted == 1
    look = await stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=tokens))
    assert look.hit_blocks == 1 and look.miss_reason == pb.MISS_REASON_ABSENT


async def test_list_blocks_pages(stub, namespace):
    ns = namespace.id
    lid = (await stub.OpenLease(pb.OpenLeaseRequest())).lease_id
    res = await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=list(range(5 * BLOCK_SIZE)))
    )
    hashes = [e.hash for e in entries_of(res)]
    await stub.Commit(
        pb.CommitRequest(
            namespace_id=ns,
            lease_id=lid,
            packed_hashes=b"".join(hashes),
            packed_checksums=stand_in_checksums(b"".join(hashes)),
        )
    )
    seen: list[bytes] = []
    token = ""
    pages = 0
    while True:
        page = await stub.ListBlocks(
            pb.ListBlocksRequest(namespace_id=ns, page_size=2, page_token=token)
        )
        assert page.total == 5 and len(page.blocks) <= 2
        seen += [b.hash for b in page.blocks]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert pages == 3 and sorted(seen) == sorted(hashes)
    first = (await stub.ListBlocks(pb.ListBlocksRequest(namespace_id=ns))).blocks[0]
    assert first.state == pb.BLOCK_STATE_READY and first.tenant == "default" and first.created > 1e9


async def test_evict_and_clear(stub, namespace):
    ns = namespace.id
    lid = (await stub.OpenLease(pb.OpenLeaseRequest())).lease_id
    res = await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=list(range(3 * BLOCK_SIZE)))
    )
    hashes = [e.hash for e in entries_of(res)]
    await stub.Commit(
        pb.CommitRequest(
            namespace_id=ns,
            lease_id=lid,
            packed_hashes=b"".join(hashes),
            packed_checksums=stand_in_checksums(b"".join(hashes)),
        )
    )
    evicted = await stub.Evict(pb.EvictRequest(namespace_id=ns, blocks=1))
    assert evicted.evicted == 1
    cleared = await stub.Clear(pb.ClearRequest(namespace_id=ns))
    assert cleared.removed == 2 and cleared.kept_pinned == 0


async def test_ping_echoes(stub):
    assert (await stub.Ping(pb.PingRequest(payload=b"hello"))).payload == b"hello"
