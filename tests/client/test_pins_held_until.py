"""`SyncClient.pins_held_until`: the deadline another process may read a hit's slots by."""

from __future__ import annotations

import asyncio
import time

from kvstore.client import SyncClient
from service.server import Server
from tests.client.blocks import LAYOUT


async def test_a_pinned_hit_is_held_until_its_lease_surely_ends(kv_server: Server) -> None:
    def scenario() -> None:
        with SyncClient(kv_server.address, tenant="acme", timeout=5.0, lease_ttl=8.0) as c:
            ns = c.register_namespace("m-held", LAYOUT, timeout=5.0)
            tokens = list(range(3 * LAYOUT.block_size))
            c.store(ns, tokens, [bytes(ns.block_bytes)] * 3, timeout=5.0)
            before = time.monotonic()
            hit = c.lookup(ns, tokens, pin=True, timeout=5.0)
            until = c.pins_held_until(hit)
            # The TTL from the confirmed open, less the safety margin (1 s here).
            assert before + 8.0 - 1.0 - 0.5 < until <= time.monotonic() + 8.0 - 1.0
            assert c.pins_held_until(c.lookup(ns, tokens, timeout=5.0)) == 0.0  # not pinned
            c.release(hit, timeout=5.0)
            assert c.pins_held_until(hit) == 0.0  # released
            again = c.lookup(ns, tokens, pin=True, timeout=5.0)
            assert again.lease_id is not None
            c.client.lease.mark_lost(again.lease_id)  # as when a KeepAlive finds it gone
            assert c.pins_held_until(again) == 0.0  # its lease is over

    await asyncio.to_thread(scenario)
