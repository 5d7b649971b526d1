"""Peer fetch between nodes that serve TLS (and mutual TLS): the peer channel uses it too."""

from __future__ import annotations

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.cluster.peer_fetch import peer_credentials
from service.config import Config, ConfigError
from tests.inproc import LAYOUT
from tests.redis.rpc import MODEL, block_bytes, prompt
from tests.replies import entries_of
from tests.waiting import until

TENANT = (("x-kvstore-tenant", "acme"),)


def tls_settings(pki, mutual: bool) -> dict[str, str]:
    settings = {"tls_cert": str(pki / "server.pem"), "tls_key": str(pki / "server.key")}
    if mutual:
        settings["tls_client_ca"] = str(pki / "ca.pem")
    else:
        settings["peer_tls_ca"] = str(pki / "ca.pem")
    return settings


async def _channel(address: str, pki) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes(),
        certificate_chain=(pki / "client.pem").read_bytes(),
    )
    return grpc.aio.secure_channel(address, creds)


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
async def test_peer_fetch_over_tls(nodes, pki, mutual):
    settings = tls_settings(pki, mutual)
    a = await nodes.start("node-a", **settings)
    b = await nodes.start("node-b", **settings)
    ca, cb = await _channel(a.address, pki), await _channel(b.address, pki)
    try:
        sa, sb = kvstore_pb2_grpc.KVStoreStub(ca), kvstore_pb2_grpc.KVStoreStub(cb)
        reg = pb.RegisterNamespaceRequest(model_id=MODEL, layout=LAYOUT)
        ns = (await sa.RegisterNamespace(reg, metadata=TENANT, timeout=10)).namespace_id
        await sb.RegisterNamespace(reg, metadata=TENANT, timeout=10)
        lease = (await sa.OpenLease(pb.OpenLeaseRequest(), metadata=TENANT)).lease_id
        tokens = prompt(4, 3)
        res = await sa.Reserve(
            pb.ReserveRequest(namespace_id=ns, lease_id=lease, tokens=tokens), metadata=TENANT
        )
        chain = [e.hash for e in entries_of(res)]
        header = pb.WriteBlocksHeader(namespace_id=ns, lease_id=lease, commit=True)
        items = [pb.WriteBlocksRequest(header=header)] + [
            pb.WriteBlocksRequest(block=pb.BlockData(hash=h, data=block_bytes(4, i)))
            for i, h in enumerate(chain)
        ]
        await sa.WriteBlocks(iter(items), metadata=TENANT, timeout=10)
        await until(lambda: b.node.cluster.locate(ns, "acme", chain), what="directory entry")
        hit = await sb.Lookup(
            pb.LookupRequest(namespace_id=ns, tokens=tokens, allow_remote=True),
            metadata=TENANT,
            timeout=10,
        )
        assert hit.hit_blocks == 3
        assert b.node.peers.fetched_blocks == 3
        assert b.node.peers.failed_fetches == 0
    finally:
        await ca.close()
        await cb.close()


def test_peer_credentials_follow_the_nodes_tls(tmp_path, pki):
    assert peer_credentials(Config()) is None
    creds = peer_credentials(Config(**tls_settings(pki, mutual=True)))
    assert isinstance(creds, grpc.ChannelCredentials)
    missing = Config(**{**tls_settings(pki, mutual=False), "peer_tls_ca": str(tmp_path / "no")})
    with pytest.raises(ConfigError, match="peer_tls_ca"):
        peer_credentials(missing)
