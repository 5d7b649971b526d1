"""Tenants never share blocks unless the operator made the namespace shared."""

from __future__ import annotations

import dataclasses

import grpc

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.server import Server
from service.tenancy.callers import ChainRoots
from tests.inproc import BLOCK_SIZE, LAYOUT, tenant
from tests.replies import chain_of, entries_of
from tests.stand_ins import stand_in_checksums

TOKENS = list(range(2 * BLOCK_SIZE))
A, B = tenant("alice"), tenant("bob")


async def store_as(stub, ns: str, who) -> list[bytes]:
    lid = (await stub.OpenLease(pb.OpenLeaseRequest(), metadata=who)).lease_id
    res = await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=TOKENS), metadata=who
    )
    hashes = [e.hash for e in entries_of(res)]
    await stub.Commit(
        pb.CommitRequest(
            namespace_id=ns,
            lease_id=lid,
            packed_hashes=b"".join(hashes),
            packed_checksums=stand_in_checksums(b"".join(hashes)),
        ),
        metadata=who,
    )
    return hashes


async def test_other_tenant_misses_same_tokens(stub, namespace):
    ns = namespace.id
    stored = await store_as(stub, ns, A)
    hit = await stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=TOKENS), metadata=A)
    assert hit.hit_blocks == 2
    miss = await stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=TOKENS), metadata=B)
    assert miss.hit_blocks == 0 and list(chain_of(miss)) != stored
    # Even A's exact hashes miss for B: B's blocks live in B's scope.
    stolen = await stub.Lookup(
        pb.LookupRequest(namespace_id=ns, packed_hashes=b"".join(stored)), metadata=B
    )
    assert stolen.hit_blocks == 0
    roots = {
        (await stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id="test-model", layout=LAYOUT), metadata=who
        )).chain_root
        for who in (A, B)
    }  # fmt: skip
    assert len(roots) == 2


async def test_shared_namespace_shares_blocks(server_config, clock):
    config = dataclasses.replace(server_config, shared_namespaces=("shared-model",))
    async with (
        Server(config, clock=clock) as server,
        grpc.aio.insecure_channel(server.address) as ch,
    ):
        stub = kvstore_pb2_grpc.KVStoreStub(ch)
        reg = await stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id="shared-model", layout=LAYOUT)
        )
        assert reg.shared
        await store_as(stub, reg.namespace_id, A)
        hit = await stub.Lookup(
            pb.LookupRequest(namespace_id=reg.namespace_id, tokens=TOKENS), metadata=B
        )
        assert hit.hit_blocks == 2


def test_salts_are_per_tenant_and_keyed():
    roots = ChainRoots(b"k" * 32)
    assert roots.salt("a") != roots.salt("b")
    assert ChainRoots(b"j" * 32).salt("a") != roots.salt("a")
