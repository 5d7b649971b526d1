"""A runner that stops renewing, and the node's clock jumping.

The node runs in process on a `ManualClock` (monotonic time plus an offset
the test moves), so a lease lapses without waiting for it.

* A runner that stops renewing (suspended, stuck in a long GC, partitioned)
  loses its lease: its pins and writes are dropped, its later calls on that
  lease fail with ``FAILED_PRECONDITION``, and another runner may write the
  keys it had reserved. The client SDK notices the loss, opens a new lease
  (a new generation) and sends nothing for the old pins.
* A far forward jump expires every lease at once, in one expiry pass whose
  cost is what the leases held; the node keeps serving.
* The node measures leases on a monotonic clock, so wall-clock jumps (NTP,
  an operator's ``date``) change nothing; a backwards step of the store's
  clock (which a monotonic clock never makes) neither resurrects an ended
  lease nor corrupts the counts.
"""

from __future__ import annotations

import inspect
import time

import grpc
import numpy as np
import pytest

from kvstore.client import Client
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.node import Node
from service.server import Server
from tests.inproc import BLOCK_BYTES, ManualClock, RegisteredNamespace
from tests.replies import blocks_of, entries_of
from tests.stand_ins import stand_in_checksums
from tests.waiting import until

HASHES = [bytes([i]) * 32 for i in range(1, 9)]


async def stats(stub) -> pb.StatsResponse:
    return await stub.Stats(pb.StatsRequest(), timeout=5)


async def store(stub, ns: RegisteredNamespace, lease: int, hashes: list[bytes]) -> None:
    resp = await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns.id, lease_id=lease, packed_hashes=b"".join(hashes)),
        timeout=5,
    )
    assert all(e.status == pb.RESERVE_STATUS_RESERVED for e in entries_of(resp))
    await stub.Commit(
        pb.CommitRequest(
            namespace_id=ns.id,
            lease_id=lease,
            packed_hashes=b"".join(hashes),
            packed_checksums=stand_in_checksums(b"".join(hashes)),
        ),
        timeout=5,
    )


async def test_a_runner_that_stops_renewing_loses_its_pins_and_writes(
    stub, namespace: RegisteredNamespace, clock: ManualClock
) -> None:
    ns = namespace
    owner = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=30), timeout=5)).lease_id
    await store(stub, ns, owner, HASHES[:4])
    slow = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=5), timeout=5)).lease_id
    hit = await stub.Lookup(
        pb.LookupRequest(
            namespace_id=ns.id, lease_id=slow, pin=True, packed_hashes=b"".join(HASHES[:4])
        ),
        timeout=5,
    )
    assert hit.pinned and hit.hit_blocks == 4
    reserved = await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns.id, lease_id=slow, packed_hashes=b"".join(HASHES)),
        timeout=5,
    )
    assert [e.status for e in entries_of(reserved)[4:]] == [pb.RESERVE_STATUS_RESERVED] * 4
    s = await stats(stub)
    assert (s.leases, s.pinned, s.writing) == (2, 4, 4)

    # The slow runner sends nothing for longer than its TTL; the owner keeps renewing.
    clock.advance(3)
    await stub.KeepAlive(pb.KeepAliveRequest(lease_id=owner), timeout=5)
    clock.advance(3)
    s = await until(
        lambda: stats(stub),
        ok=lambda s: s.leases_expired == 1,
        within=5.0,
        what="the slow runner's lease to expire",
    )
    assert (s.leases, s.pinned, s.writing) == (1, 0, 0)
    [nss] = s.namespaces
    # Its four WRITING slots rest in quarantine: it may still be copying (late writers).
    assert (nss.quarantined, nss.free + nss.quarantined + nss.ready) == (4, nss.capacity)

    # Its late calls fail with FAILED_PRECONDITION; none of them acts.
    for call, req in [
        (stub.KeepAlive, pb.KeepAliveRequest(lease_id=slow)),
        (
            stub.Commit,
            pb.CommitRequest(
                namespace_id=ns.id,
                lease_id=slow,
                packed_hashes=b"".join(HASHES[4:]),
                packed_checksums=stand_in_checksums(b"".join(HASHES[4:])),
            ),
        ),
        (
            stub.Release,
            pb.ReleaseRequest(
                namespace_id=ns.id, lease_id=slow, packed_hashes=b"".join(HASHES[:4])
            ),
        ),
        (
            stub.Lookup,
            pb.LookupRequest(
                namespace_id=ns.id, lease_id=slow, pin=True, packed_hashes=b"".join(HASHES)
            ),
        ),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(req, timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
    read = stub.ReadBlocks(
        pb.ReadBlocksRequest(
            namespace_id=ns.id,
            lease_id=slow,
            blocks=[
                pb.BlockRef(hash=b.hash, slot=b.slot, generation=b.generation)
                for b in blocks_of(hit)
            ],
        ),
        timeout=5,
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in read:
            pass
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    # The keys it had reserved are free for another runner to write.
    await store(stub, ns, owner, HASHES[4:])
    look = await stub.Lookup(
        pb.LookupRequest(namespace_id=ns.id, packed_hashes=b"".join(HASHES)), timeout=5
    )
    assert look.hit_blocks == 8
    s = await stats(stub)
    assert (s.leases, s.pinned, s.writing) == (1, 0, 0)


async def test_the_sdk_replaces_a_lapsed_lease_and_never_releases_under_the_new_one(
    kv_server: Server, clock: ManualClock
) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float16")
    tokens = list(range(1, 17))  # 4 blocks
    async with Client(kv_server.address, lease_ttl=6.0, timeout=5.0) as client:
        ns = await client.register_namespace("slow-model", layout)
        blocks = [np.full(BLOCK_BYTES, i, dtype=np.uint8) for i in range(4)]
        assert (await client.store(ns, tokens, blocks)).committed == 4
        hit = await client.lookup(ns, tokens, pin=True)
        assert hit.pinned and hit.hit_blocks == 4
        old_lease, old_generation = await client.lease.current()

        clock.advance(10)  # from the node's side the runner went silent for 10 s
        await until(
            client.stats,
            ok=lambda s: s.leases_expired == 1 and s.pinned == 0,
            within=5.0,
            what="the lease to expire on the node",
        )
        # The next pinned lookup finds the lease gone, opens a new one and pins again.
        again = await client.lookup(ns, tokens, pin=True)
        assert again.hit_blocks == 4 and again.pinned
        new_lease, new_generation = await client.lease.current()
        assert new_lease != old_lease
        assert new_generation == old_generation + 1 == again.lease_generation
        assert client.lease.lost == 1
        # Releasing the old hit sends nothing: its pins died with the old lease, and
        # the new lease's pins (the second lookup's) must not be dropped by it.
        assert await client.release(hit) == 0
        s = await client.stats()
        assert (s.leases, s.pinned) == (1, 4)
        assert await client.release(again) == 4
        s = await client.stats()
        assert (s.leases, s.pinned, s.writing) == (1, 0, 0)


async def test_a_far_forward_jump_expires_every_lease_at_once(
    kv_server: Server, stub, namespace: RegisteredNamespace, clock: ManualClock
) -> None:
    ns = namespace
    leases = []
    for i in range(30):  # 60 WRITING slots of the 64
        lease = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=30), timeout=5)).lease_id
        chain = [bytes([i + 1, k]) * 16 for k in range(2)]
        await stub.Reserve(
            pb.ReserveRequest(namespace_id=ns.id, lease_id=lease, packed_hashes=b"".join(chain)),
            timeout=5,
        )
        leases.append(lease)
    s = await stats(stub)
    assert (s.leases, s.writing) == (30, 60)

    clock.advance(10 * 365 * 86400.0)  # ten years
    s = await until(
        lambda: stats(stub),
        ok=lambda s: s.leases == 0,
        within=5.0,
        what="every lease to expire after the jump",
    )
    assert (s.leases_expired, s.pinned, s.writing) == (30, 0, 0)
    [nss] = s.namespaces
    # The slots they were writing are quarantined from the new now on, not freed.
    assert (nss.quarantined, nss.free + nss.quarantined) == (60, nss.capacity)
    assert (await stub.Ping(pb.PingRequest(payload=b"x"), timeout=5)).payload == b"x"
    # Life goes on at the new time: a new lease lives its TTL from the new now.
    lease = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=5), timeout=5)).lease_id
    clock.advance(3)
    assert (await stub.KeepAlive(pb.KeepAliveRequest(lease_id=lease), timeout=5)).ttl_seconds > 4


async def test_a_backwards_step_neither_resurrects_nor_corrupts_leases(
    stub, namespace: RegisteredNamespace, clock: ManualClock
) -> None:
    ns = namespace
    dead = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=2), timeout=5)).lease_id
    live = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=30), timeout=5)).lease_id
    await store(stub, ns, live, HASHES[:2])
    await stub.Lookup(
        pb.LookupRequest(
            namespace_id=ns.id, lease_id=dead, pin=True, packed_hashes=b"".join(HASHES[:2])
        ),
        timeout=5,
    )
    clock.advance(5)
    await until(lambda: stats(stub), ok=lambda s: s.leases_expired == 1, within=5.0, what="expiry")

    clock.advance(-3600)  # a monotonic clock never does this; the store must stay sane
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.KeepAlive(pb.KeepAliveRequest(lease_id=dead), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # still ended
    s = await stats(stub)
    assert (s.leases, s.pinned, s.writing) == (1, 0, 0)
    # The live lease keeps working, pins and releases balance.
    hit = await stub.Lookup(
        pb.LookupRequest(
            namespace_id=ns.id, lease_id=live, pin=True, packed_hashes=b"".join(HASHES[:2])
        ),
        timeout=5,
    )
    assert hit.hit_blocks == 2
    released = await stub.Release(
        pb.ReleaseRequest(namespace_id=ns.id, lease_id=live, packed_hashes=b"".join(HASHES[:2])),
        timeout=5,
    )
    assert released.released == 2
    clock.advance(3600 + 60)  # back past the live lease's deadline too
    s = await until(lambda: stats(stub), ok=lambda s: s.leases == 0, within=5.0, what="expiry")
    assert (s.leases_expired, s.pinned, s.writing) == (2, 0, 0)
    [nss] = s.namespaces
    assert nss.free + nss.quarantined + nss.ready == nss.capacity


def test_leases_run_on_a_monotonic_clock_not_the_wall_clock() -> None:
    # Wall-clock jumps (NTP steps, `date -s`) cannot expire or extend a lease:
    # the store's `now` comes from time.monotonic unless a test injects a clock.
    assert inspect.signature(Server.__init__).parameters["clock"].default is time.monotonic
    assert inspect.signature(Node.__init__).parameters["clock"].default is time.monotonic


async def test_a_wall_clock_jump_does_not_touch_leases(
    server_config, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = Server(server_config, expiry_tick=0.02)  # the real monotonic clock
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            lease = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=5), timeout=5)).lease_id
            real = time.time
            # The node's wall clock (event and ListBlocks timestamps only) jumps a day
            # forward, then back. (Patching time.time itself would break gRPC's own
            # deadlines in this process, which are wall-clock based.)
            monkeypatch.setattr(server.node, "wall", lambda: real() + 86400.0)
            await stub.KeepAlive(pb.KeepAliveRequest(lease_id=lease), timeout=5)
            monkeypatch.setattr(server.node, "wall", lambda: real() - 86400.0)
            s = await stub.Stats(pb.StatsRequest(), timeout=5)
            assert (s.leases, s.leases_expired) == (1, 0)
            kept = await stub.KeepAlive(pb.KeepAliveRequest(lease_id=lease), timeout=5)
            assert 4.0 < kept.ttl_seconds <= 5.0
    finally:
        await server.stop(0.1)
