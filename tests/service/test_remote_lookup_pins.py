"""A pinned Lookup with ``allow_remote`` never leaves the first lookup's pins behind.

The servicer pins the local hits, awaits the peer fetch, then looks up again.
The peer fetcher is faked here (no Redis): it either stores the missing
block itself (as a real fetch would) or blocks until the call is cancelled.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from kvstore.types import BlockHash, LeaseId, NamespaceId, TenantId
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.server import Server
from tests.service.conftest import BLOCK_SIZE, LAYOUT
from tests.service.test_leases import wait_for_stats


class StoringPeers:
    """Fetches by committing the missing blocks straight into the store."""

    def __init__(self, node) -> None:
        self.node = node

    async def fetch(
        self, namespace: NamespaceId, tenant: TenantId, chain: list[BlockHash], have: int
    ) -> int:
        store, now = self.node.store, self.node.now()
        lease = LeaseId(0x5EED)
        store.open_lease(lease, tenant, 5.0, now)
        store.reserve(namespace, tenant, lease, chain, now)
        store.commit(namespace, tenant, lease, chain[have:], now)
        store.close_lease(lease, tenant, now)
        return len(chain) - have

    async def close(self) -> None:
        """Nothing to close (the server's shutdown calls it)."""


class HangingPeers:
    """A fetch that never ends (a slow peer) until the call is cancelled."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def fetch(self, *args: object) -> int:
        self.entered.set()
        await asyncio.Event().wait()
        return 0  # pragma: no cover

    async def close(self) -> None:
        """Nothing to close (the server's shutdown calls it)."""


async def _store_prefix(stub, ns: str, tokens: list[int], blocks: int) -> None:
    lid = (await stub.OpenLease(pb.OpenLeaseRequest())).lease_id
    res = await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=tokens))
    hashes = [e.hash for e in res.entries[:blocks]]
    await stub.Commit(pb.CommitRequest(namespace_id=ns, lease_id=lid, hashes=hashes))
    await stub.CloseLease(pb.CloseLeaseRequest(lease_id=lid))


async def test_cancelled_remote_lookup_releases_its_local_pins(stub, namespace, kv_server):
    ns = namespace.id
    tokens = list(range(3 * BLOCK_SIZE))
    await _store_prefix(stub, ns, tokens, 2)
    peers = HangingPeers()
    kv_server.node.peers = peers  # type: ignore[assignment]
    lid = (await stub.OpenLease(pb.OpenLeaseRequest())).lease_id
    call = stub.Lookup(
        pb.LookupRequest(namespace_id=ns, lease_id=lid, pin=True, tokens=tokens, allow_remote=True)
    )
    await asyncio.wait_for(peers.entered.wait(), 5)
    assert (await stub.Stats(pb.StatsRequest())).pinned == 2  # the local hits, mid-fetch
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # The caller never learnt of those pins: the node must drop them itself.
    stats = await wait_for_stats(stub, lambda s: s.pinned == 0)
    assert stats.leases == 1


async def test_remote_lookup_near_the_pin_bound_does_not_count_its_first_pins(server_config, clock):
    server = Server(replace(server_config, max_pins_per_lease=3), clock=clock, expiry_tick=0.02)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            reg = await stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(model_id="m", layout=LAYOUT)
            )
            ns = reg.namespace_id
            tokens = list(range(3 * BLOCK_SIZE))
            await _store_prefix(stub, ns, tokens, 2)
            server.node.peers = StoringPeers(server.node)  # type: ignore[assignment]
            lid = (await stub.OpenLease(pb.OpenLeaseRequest())).lease_id
            resp = await stub.Lookup(
                pb.LookupRequest(
                    namespace_id=ns, lease_id=lid, pin=True, tokens=tokens, allow_remote=True
                )
            )
            assert resp.hit_blocks == 3 and resp.pinned
            stats = await stub.Stats(pb.StatsRequest())
            assert stats.pinned == 3
            released = await stub.Release(
                pb.ReleaseRequest(namespace_id=ns, lease_id=lid, hashes=resp.chain)
            )
            assert released.released == 3
            assert (await stub.Stats(pb.StatsRequest())).pinned == 0
    finally:
        await server.stop(0.1)
