"""A Lookup with ``allow_remote``: pins, eviction, leases and the peer's stream.

The servicer pins the local hits, awaits the peer fetch, then looks up again.
Without Redis: the first tests fake the whole fetcher (it stores the missing
blocks itself, or blocks until cancelled); the later ones run the real
`PeerFetcher` against a fake peer (a gRPC server whose FetchBlocks is
scripted) named by a fake directory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest

from kvstore.checksum import block_checksum
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.cluster.directory import PeerHolder
from service.cluster.peer_fetch import PeerFetcher
from service.server import Server
from tests.inproc import BLOCK_BYTES, BLOCK_SIZE, LAYOUT, tenant
from tests.redis.server import free_port
from tests.replies import chain_of, entries_of
from tests.service.peers import StoringPeers
from tests.stand_ins import stand_in_checksums
from tests.waiting import until


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
    hashes = [e.hash for e in entries_of(res)[:blocks]]
    await stub.Commit(
        pb.CommitRequest(
            namespace_id=ns,
            lease_id=lid,
            packed_hashes=b"".join(hashes),
            packed_checksums=stand_in_checksums(b"".join(hashes)),
        )
    )
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
    stats = await until(
        lambda: stub.Stats(pb.StatsRequest()),
        ok=lambda s: s.pinned == 0,
        within=5.0,
        what="the node to drop the cancelled lookup's pins",
    )
    assert stats.leases == 1


@contextlib.asynccontextmanager
async def node_with(
    server_config, clock, **changes: object
) -> AsyncIterator[tuple[Server, kvstore_pb2_grpc.KVStoreStub, str]]:
    """A node with ``changes`` to the test config, a stub to it and a namespace "m"."""
    server = Server(replace(server_config, **changes), clock=clock, expiry_tick=0.02)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            reg = await stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(model_id="m", layout=LAYOUT)
            )
            yield server, stub, reg.namespace_id
    finally:
        await server.stop(0.1)


async def test_remote_lookup_near_the_pin_bound_does_not_count_its_first_pins(server_config, clock):
    async with node_with(server_config, clock, max_pins_per_lease=3) as (server, stub, ns):
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
            pb.ReleaseRequest(namespace_id=ns, lease_id=lid, packed_hashes=b"".join(chain_of(resp)))
        )
        assert released.released == 3
        assert (await stub.Stats(pb.StatsRequest())).pinned == 0


class FakePeer(kvstore_pb2_grpc.KVStoreServicer):
    """A peer whose FetchBlocks sends ``block_bytes``-sized blocks, then maybe hangs."""

    def __init__(self) -> None:
        self.block_bytes = BLOCK_BYTES
        self.hang = False
        self.address = ""
        self.calls = 0
        self.ended = asyncio.Event()

    async def FetchBlocks(self, request, context):
        self.calls += 1
        try:
            for h in request.hashes[request.skip :]:
                data = bytes([7]) * self.block_bytes
                yield pb.BlockData(hash=h, data=data, checksum=block_checksum(data))
            if self.hang:
                await asyncio.Event().wait()
        finally:  # cancelled: grpc closes the generator (GeneratorExit)
            self.ended.set()


@pytest.fixture
async def fake_peer():
    peer = FakePeer()
    server = grpc.aio.server()
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(peer, server)
    peer.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        yield peer
    finally:
        await server.stop(0)


def use_peer(server: Server, address: str, blocks: int) -> PeerFetcher:
    """Give the node a real fetcher whose directory names ``address`` as the holder."""

    async def locate(namespace, scope, chain) -> list[PeerHolder]:
        return [PeerHolder("peer", address, blocks)]

    fetcher = PeerFetcher(server.node, locate)
    server.node.peers = fetcher
    return fetcher


async def _lookup(stub, ns: str, tokens: list[int], who: str = "default") -> pb.LookupResponse:
    request = pb.LookupRequest(namespace_id=ns, tokens=tokens, allow_remote=True)
    return await stub.Lookup(request, metadata=tenant(who), timeout=30)


async def test_a_dead_holder_evicts_nothing(stub, namespace, kv_server):
    # Another tenant fills the namespace; the directory names a holder that is gone.
    md = tenant("other")
    lid = (await stub.OpenLease(pb.OpenLeaseRequest(), metadata=md)).lease_id
    tokens = [10_000 + i for i in range(namespace.capacity * BLOCK_SIZE)]
    res = await stub.Reserve(
        pb.ReserveRequest(namespace_id=namespace.id, lease_id=lid, tokens=tokens), metadata=md
    )
    hashes = [e.hash for e in entries_of(res)]
    await stub.Commit(
        pb.CommitRequest(
            namespace_id=namespace.id,
            lease_id=lid,
            packed_hashes=b"".join(hashes),
            packed_checksums=stand_in_checksums(b"".join(hashes)),
        ),
        metadata=md,
    )
    await stub.CloseLease(pb.CloseLeaseRequest(lease_id=lid), metadata=md)
    fetcher = use_peer(kv_server, f"127.0.0.1:{free_port()}", 4)
    resp = await _lookup(stub, namespace.id, list(range(4 * BLOCK_SIZE)), "acme")
    assert resp.hit_blocks == 0
    assert fetcher.failed_fetches == 1
    table = kv_server.node.table(namespace.id)
    assert table.stats().evictions == 0  # contact first, then make room
    assert len(list(table.iter_blocks())) == namespace.capacity


async def test_peer_fetch_works_with_the_tenant_at_its_lease_limit(server_config, clock, fake_peer):
    async with node_with(server_config, clock, max_leases_per_tenant=1) as (server, stub, ns):
        await stub.OpenLease(pb.OpenLeaseRequest())  # the tenant's one lease
        fetcher = use_peer(server, fake_peer.address, 4)
        resp = await _lookup(stub, ns, list(range(4 * BLOCK_SIZE)))
        assert resp.hit_blocks == 4
        assert fetcher.fetched_blocks == 4
        # The internal lease is gone and the tenant is still at exactly its limit.
        assert (await stub.Stats(pb.StatsRequest())).leases == 1
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.OpenLease(pb.OpenLeaseRequest())
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_wrong_sized_block_cancels_the_peers_stream(server_config, clock, fake_peer):
    # A long timeout: the peer's stream must end because we cancel it, not by deadline.
    async with node_with(server_config, clock, peer_fetch_timeout=120.0) as (server, stub, ns):
        fake_peer.block_bytes = BLOCK_BYTES - 1
        fake_peer.hang = True
        fetcher = use_peer(server, fake_peer.address, 4)
        resp = await _lookup(stub, ns, list(range(4 * BLOCK_SIZE)))
        assert resp.hit_blocks == 0
        assert fetcher.failed_fetches == 1
        await asyncio.wait_for(fake_peer.ended.wait(), 10)
        # Nothing was reserved for the bad stream, so nothing is left WRITING.
        assert (await stub.Stats(pb.StatsRequest())).writing == 0
