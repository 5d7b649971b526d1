"""A pinned lookup whose answer shows an epoch change releases under the lease that pinned.

When a pinned Lookup's answer carries a new pool epoch, the client drops the
hit (its locations refer to a pool it has not mapped) and releases its pins
in the background before looking up again. The pins belong to the lease the
Lookup was sent with; if that lease was replaced meanwhile, a release under
the new lease would drop the new lease's pins of the same blocks, which a
live hit of the runner still holds (the same rule as for a cancelled pinned
lookup, ``test_cancel_after_lease_loss.py``).
"""

from __future__ import annotations

import asyncio

from kvstore.client import Client
from kvstore.client.methods import Unary
from tests.client.blocks import LAYOUT, TOKENS, block
from tests.waiting import until


async def test_epoch_change_cleanup_never_releases_the_next_leases_pins(kv: Client, clock):
    ns = await kv.register_namespace("m", LAYOUT)
    await kv.store(ns, TOKENS, [block(i) for i in range(5)])
    old_lease = kv.lease.lease_id
    real_call = kv._rpc.call
    live_hits = []
    first = True

    async def call(method: Unary, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal first
        resp = await real_call(method, request, *args, **kwargs)
        if method.name == "Lookup" and request.pin and first:
            first = False
            # Before the answer reaches the runner, its lease lapses on the
            # node and the client replaces it; a live hit pins the blocks again.
            clock.advance(kv.lease_ttl + 1)
            await until(
                kv.stats,
                ok=lambda s: s.leases_expired == 1,
                within=5.0,
                what="the lease to lapse on the node",
            )
            assert not await kv.lease.renew_now()
            live_hits.append(await kv.lookup(ns, TOKENS, pin=True))
            resp.pool_epoch += 1  # the answer looks like it came from a restarted node
        return resp

    kv._rpc.call = call  # type: ignore[method-assign]
    hit = await kv.lookup(ns, TOKENS, pin=True)  # retried after the "epoch change"
    await asyncio.gather(*kv._background)
    [live] = live_hits
    assert kv.lease.lease_id != old_lease and live.hit_blocks == hit.hit_blocks == 5
    # The first answer's pins went with the old lease; the live hit and the
    # retried lookup each hold five pins under the new one.
    assert (await kv.stats()).pinned == 10
    assert await kv.release(live) == 5
    assert await kv.release(hit) == 5
