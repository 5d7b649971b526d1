"""A cancelled pinned lookup releases its pins under the lease that took them.

The cleanup runs once the Lookup's answer arrives. If the client's lease was
lost and replaced meanwhile, the answer's pins went with the old lease; a
release sent under the new lease would drop that lease's pins of the same
blocks, which a live hit of the runner still holds.
"""

from __future__ import annotations

import asyncio

import pytest

from kvstore.client import Client
from kvstore.client.methods import Unary
from tests.client.blocks import LAYOUT, TOKENS, block
from tests.waiting import until


async def test_cancelled_pinned_lookup_never_releases_the_next_leases_pins(kv: Client, clock):
    ns = await kv.register_namespace("m", LAYOUT)
    await kv.store(ns, TOKENS, [block(i) for i in range(5)])
    old_lease = kv.lease.lease_id

    answered = asyncio.Event()
    gate = asyncio.Event()
    real_call = kv._rpc.call
    gated = True

    async def call(method: Unary, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal gated
        resp = await real_call(method, request, *args, **kwargs)
        if method.name == "Lookup" and request.pin and gated:
            gated = False
            answered.set()
            await gate.wait()  # the answer is slow to reach the runner
        return resp

    kv._rpc.call = call  # type: ignore[method-assign]
    task = asyncio.ensure_future(kv.lookup(ns, TOKENS, pin=True))
    await asyncio.wait_for(answered.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    # The lease lapses on the node (pins dropped) and the client replaces it.
    clock.advance(kv.lease_ttl + 1)
    await until(kv.stats, ok=lambda s: s.leases_expired == 1, within=5.0, what="the lease to lapse")
    assert not await kv.lease.renew_now()
    hit = await kv.lookup(ns, TOKENS, pin=True)
    assert kv.lease.lease_id != old_lease and hit.hit_blocks == 5
    assert (await kv.stats()).pinned == 5

    gate.set()  # the cancelled lookup's answer arrives: its cleanup runs
    await asyncio.gather(*kv._background)
    assert (await kv.stats()).pinned == 5  # the live hit keeps its pins
    assert await kv.release(hit) == 5
