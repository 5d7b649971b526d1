"""A Lookup or Reserve cancelled in flight leaves nothing behind.

Large Reserve replies are built on a worker thread (`service.api.offload`),
after the store has reserved the blocks: a client that cancels meanwhile
never learns of them, so the node aborts those reservations itself. A
Lookup's reply is built on the loop with no await after its pins.
"""

from __future__ import annotations

import asyncio

import pytest

from kvstore.v1 import kvstore_pb2 as pb
from service.api import blocks as blocks_module
from service.api import chains as chains_module
from tests.replies import entries_of
from tests.stand_ins import stand_in_checksums
from tests.waiting import until

TOKENS = list(range(1, 33))  # 8 blocks of the test layout


@pytest.fixture
def stalled_replies(monkeypatch):
    """Make every off-loop reply wait until the test lets it go; yields (entered, release)."""
    entered = asyncio.Event()
    release = asyncio.Event()
    real = blocks_module.off_loop

    async def stalled(size, fn, *args):
        entered.set()
        await release.wait()
        return await real(size, fn, *args)

    monkeypatch.setattr(blocks_module, "off_loop", stalled)
    return entered, release


async def stats(stub):
    return await stub.Stats(pb.StatsRequest(), timeout=5)


async def test_a_lookup_cancelled_in_flight_leaves_no_pins(stub, namespace, monkeypatch):
    # A Lookup builds its reply on the loop, with no await after the pins are
    # taken: a cancellation that reaches the node lands before the lookup (here:
    # while the chain is hashed), never between pins and reply.
    lease = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=60))).lease_id
    ns = namespace.id
    res = await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lease, tokens=TOKENS))
    await stub.Commit(
        pb.CommitRequest(
            namespace_id=ns,
            lease_id=lease,
            packed_hashes=b"".join([e.hash for e in entries_of(res)]),
            packed_checksums=stand_in_checksums(b"".join([e.hash for e in entries_of(res)])),
        )
    )
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def stalled(size, fn, *args):
        entered.set()
        try:
            await asyncio.Event().wait()  # until the node cancels the handler
        except asyncio.CancelledError:
            cancelled.set()
            raise

    monkeypatch.setattr(chains_module, "off_loop", stalled)
    call = stub.Lookup(pb.LookupRequest(namespace_id=ns, lease_id=lease, pin=True, tokens=TOKENS))
    await asyncio.wait_for(entered.wait(), 5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.wait_for(cancelled.wait(), 5)
    assert (await stats(stub)).pinned == 0


async def test_a_reserve_cancelled_mid_reply_aborts_its_slots(stub, namespace, stalled_replies):
    lease = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=60))).lease_id
    entered, _ = stalled_replies
    call = stub.Reserve(pb.ReserveRequest(namespace_id=namespace.id, lease_id=lease, tokens=TOKENS))
    await asyncio.wait_for(entered.wait(), 5)
    assert (await stats(stub)).writing == 8
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await until(
        lambda: stats(stub), ok=lambda r: r.writing == 0, within=5.0, what="no writing blocks"
    )
