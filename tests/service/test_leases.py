"""Lease expiry frees pins and writes; the expiry task runs on its own."""

from __future__ import annotations

from kvstore.v1 import kvstore_pb2 as pb
from tests.inproc import BLOCK_SIZE
from tests.replies import entries_of
from tests.stand_ins import stand_in_checksums
from tests.waiting import until


async def test_expiry_frees_pins_and_writes(stub, namespace, clock, kv_server):
    ns = namespace.id
    lid = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=5))).lease_id
    tokens = list(range(2 * BLOCK_SIZE))
    res = await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=tokens))
    first, second = (e.hash for e in entries_of(res))
    await stub.Commit(
        pb.CommitRequest(
            namespace_id=ns,
            lease_id=lid,
            packed_hashes=b"".join([first]),
            packed_checksums=stand_in_checksums(b"".join([first])),
        )
    )
    await stub.Lookup(
        pb.LookupRequest(namespace_id=ns, lease_id=lid, pin=True, packed_hashes=b"".join([first]))
    )
    stats = await stub.Stats(pb.StatsRequest())
    assert stats.pinned == 1 and stats.writing == 1 and stats.leases == 1

    clock.advance(6)
    stats = await until(  # the expiry task runs every few ms
        lambda: stub.Stats(pb.StatsRequest()),
        ok=lambda s: s.leases_expired == 1,
        within=5.0,
        what="the lease to expire",
    )
    assert stats.leases == 0 and stats.pinned == 0 and stats.writing == 0
    (ns_stats,) = stats.namespaces
    assert ns_stats.pinned == 0 and ns_stats.writing == 0 and ns_stats.ready == 1
    assert b"kvstore_lease_expiries_total 1.0" in kv_server.node.metrics.render()

    # The write the dead lease held is free for another lease to take.
    other = (await stub.OpenLease(pb.OpenLeaseRequest())).lease_id
    again = await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns, lease_id=other, packed_hashes=b"".join([first, second]))
    )
    assert [e.status for e in entries_of(again)] == [
        pb.RESERVE_STATUS_HIT,
        pb.RESERVE_STATUS_RESERVED,
    ]


async def test_keepalive_keeps_a_lease(stub, clock):
    lid = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=5))).lease_id
    for _ in range(3):
        clock.advance(3)
        await stub.KeepAlive(pb.KeepAliveRequest(lease_id=lid))
    stats = await stub.Stats(pb.StatsRequest())
    assert stats.leases == 1 and stats.leases_expired == 0
