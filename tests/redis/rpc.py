"""Raw-stub helpers for the cluster tests: register, store bytes, look up, read."""

from __future__ import annotations

import grpc

from kvstore.checksum import block_checksum
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from tests.inproc import BLOCK_BYTES, BLOCK_SIZE, LAYOUT
from tests.replies import blocks_of, entries_of

MODEL = "cluster-model"


def tenant_md(name: str) -> tuple[tuple[str, str], ...]:
    return (("x-kvstore-tenant", name),)


def prompt(seed: int, blocks: int) -> list[int]:
    """Tokens of ``blocks`` full blocks, distinct per seed."""
    return [seed * 100_000 + i for i in range(blocks * BLOCK_SIZE)]


def block_bytes(seed: int, index: int) -> bytes:
    """Deterministic, distinct bytes of one block."""
    return bytes((seed * 31 + index * 7 + j) % 251 for j in range(BLOCK_BYTES))


class Rpc:
    """One channel to one node, with a tenant."""

    def __init__(self, address: str, tenant: str = "default") -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = kvstore_pb2_grpc.KVStoreStub(self.channel)
        self.md = tenant_md(tenant)
        self.namespace = ""

    async def close(self) -> None:
        await self.channel.close()

    async def register(self, model: str = MODEL) -> str:
        resp = await self.stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id=model, layout=LAYOUT), metadata=self.md, timeout=10
        )
        self.namespace = resp.namespace_id
        return self.namespace

    async def store(self, seed: int, blocks: int) -> list[bytes]:
        """Store a prompt's blocks (bytes from `block_bytes`, with their checksums); returns
        the chain."""
        lease = await self.stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=30), metadata=self.md)
        tokens = prompt(seed, blocks)
        res = await self.stub.Reserve(
            pb.ReserveRequest(namespace_id=self.namespace, lease_id=lease.lease_id, tokens=tokens),
            metadata=self.md,
            timeout=10,
        )
        items = [
            pb.WriteBlocksRequest(
                header=pb.WriteBlocksHeader(
                    namespace_id=self.namespace, lease_id=lease.lease_id, commit=True
                )
            )
        ]
        for i, entry in enumerate(entries_of(res)):
            if entry.status == pb.RESERVE_STATUS_RESERVED:
                items.append(
                    pb.WriteBlocksRequest(
                        block=pb.BlockData(
                            hash=entry.hash,
                            data=block_bytes(seed, i),
                            checksum=block_checksum(block_bytes(seed, i)),
                        )
                    )
                )
        await self.stub.WriteBlocks(iter(items), metadata=self.md, timeout=10)
        await self.stub.CloseLease(pb.CloseLeaseRequest(lease_id=lease.lease_id), metadata=self.md)
        return [e.hash for e in entries_of(res)]

    async def lookup(self, seed: int, blocks: int, *, remote: bool = False, deadline: float = 10):
        return await self.stub.Lookup(
            pb.LookupRequest(
                namespace_id=self.namespace, tokens=prompt(seed, blocks), allow_remote=remote
            ),
            metadata=self.md,
            timeout=deadline,
        )

    async def read(self, seed: int, blocks: int) -> list[bytes]:
        """Pin the cached prefix and read its bytes over gRPC."""
        lease = await self.stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=30), metadata=self.md)
        hit = await self.stub.Lookup(
            pb.LookupRequest(
                namespace_id=self.namespace, lease_id=lease.lease_id, pin=True,
                tokens=prompt(seed, blocks),
            ),
            metadata=self.md, timeout=10,
        )  # fmt: skip
        refs = [
            pb.BlockRef(hash=b.hash, slot=b.slot, generation=b.generation) for b in blocks_of(hit)
        ]
        data = []
        if refs:
            call = self.stub.ReadBlocks(
                pb.ReadBlocksRequest(
                    namespace_id=self.namespace, lease_id=lease.lease_id, blocks=refs
                ),
                metadata=self.md, timeout=10,
            )  # fmt: skip
            data = [msg.data async for msg in call]
        await self.stub.CloseLease(pb.CloseLeaseRequest(lease_id=lease.lease_id), metadata=self.md)
        return data
