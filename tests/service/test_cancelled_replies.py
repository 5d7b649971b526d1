"""A Lookup or Reserve cancelled while its reply is built off the loop leaves nothing behind.

Large replies are built on a worker thread (`service.api.offload`), after the
store has pinned or reserved the blocks. A client that cancels meanwhile
never learns of them, so the node drops those pins and aborts those
reservations itself.
"""

from __future__ import annotations

import asyncio

import pytest

from kvstore.v1 import kvstore_pb2 as pb
from service.api import blocks as blocks_module
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


async def test_a_lookup_cancelled_mid_reply_drops_its_pins(stub, namespace, stalled_replies):
    lease = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=60))).lease_id
    ns = namespace.id
    entered, release = stalled_replies
    release.set()  # storing the chain is not under test
    res = await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lease, tokens=TOKENS))
    await stub.Commit(
        pb.CommitRequest(namespace_id=ns, lease_id=lease, hashes=[e.hash for e in res.entries])
    )
    release.clear()
    entered.clear()
    call = stub.Lookup(pb.LookupRequest(namespace_id=ns, lease_id=lease, pin=True, tokens=TOKENS))
    await asyncio.wait_for(entered.wait(), 5)
    assert (await stats(stub)).pinned == 8  # pinned, the reply not yet built
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await until(
        lambda: stats(stub), ok=lambda r: r.pinned == 0, within=5.0, what="no pinned blocks"
    )


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
