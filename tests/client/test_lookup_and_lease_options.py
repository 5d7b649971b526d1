"""SDK options that reach the node: ``lookup(allow_remote=)`` and the node's lease TTL."""

from __future__ import annotations

import asyncio
import dataclasses

from kvstore.client import Client, SyncClient
from service.server import Server
from tests.client.blocks import LAYOUT, TOKENS, block
from tests.service.peers import StoringPeers
from tests.waiting import until


async def test_allow_remote_lookup_fetches_the_rest_from_a_peer(kv: Client, kv_server: Server):
    ns = await kv.register_namespace("m", LAYOUT)
    await kv.store(ns, TOKENS[:8], [block(i) for i in range(2)])  # 2 of the 5 blocks here
    sent = []
    real = kv._rpc.call

    async def call(method, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        if method.name == "Lookup":
            sent.append(request)
        return await real(method, request, *args, **kwargs)

    kv._rpc.call = call  # type: ignore[method-assign]
    kv_server.node.peers = StoringPeers(kv_server.node)  # type: ignore[assignment]

    local = await kv.lookup(ns, TOKENS)
    assert local.hit_blocks == 2 and not sent[-1].allow_remote
    remote = await kv.lookup(ns, TOKENS, pin=True, allow_remote=True)
    assert sent[-1].allow_remote
    assert remote.hit_blocks == 5 and remote.pinned  # the peer's blocks, pinned with ours
    assert await kv.release(remote) == 5


async def test_sync_client_passes_allow_remote(kv_server: Server):
    kv_server.node.peers = StoringPeers(kv_server.node)  # type: ignore[assignment]

    def blocking() -> int:  # in a thread: the node runs on this test's loop
        with SyncClient(kv_server.address, tenant="acme", timeout=5.0) as kv:
            ns = kv.register_namespace("m", LAYOUT)
            kv.store(ns, TOKENS[:4], [block(0)])
            return kv.lookup(ns, TOKENS, allow_remote=True).hit_blocks

    assert await asyncio.to_thread(blocking) == 5


async def test_default_client_takes_the_nodes_lease_ttl_and_keeps_it_alive(server_config, clock):
    # A node that allows at most 5 s leases refused every default client (30 s asked).
    config = dataclasses.replace(server_config, lease_ttl_max=5.0, lease_ttl_default=3.0)
    server = Server(config, clock=clock, expiry_tick=0.02)
    await server.start()
    try:
        async with Client(server.address, tenant="acme", timeout=5.0) as kv:
            assert kv.lease_ttl is None  # nothing asked: the node decides
            renewals = 0
            real = kv._rpc.call

            async def call(method, request, *args, **kwargs):  # type: ignore[no-untyped-def]
                nonlocal renewals
                resp = await real(method, request, *args, **kwargs)
                renewals += method.name == "KeepAlive"
                return resp

            kv._rpc.call = call  # type: ignore[method-assign]
            ns = await kv.register_namespace("m", LAYOUT)
            await kv.store(ns, TOKENS, [block(i) for i in range(5)])
            hit = await kv.lookup(ns, TOKENS, pin=True)
            lease = kv.lease.lease_id
            assert kv.lease_ttl == 3.0 and kv.lease.ttl == 3.0  # granted by the node
            # The node's clock runs (real time) and jumps 1 s after each renewal: over
            # 4 renewals it passes the 3 s TTL twice, and the lease lives only because
            # the client renews at a third of the TTL the node granted.
            for _ in range(4):
                seen = renewals
                await until(lambda seen=seen: renewals > seen, within=10.0, interval=0.02)
                clock.advance(1.0)
            stats = await kv.stats()
            assert stats.leases_expired == 0 and stats.pinned == 5
            assert kv.lease.lease_id == lease and kv.lease.lost == 0
            assert await kv.release(hit) == 5
    finally:
        await server.stop(0.1)
