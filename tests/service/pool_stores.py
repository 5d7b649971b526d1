"""Stores of real bytes (WriteBlocks) into a namespace's pool, and a full-size layout."""

from __future__ import annotations

from kvstore.v1 import kvstore_pb2 as pb
from tests.inproc import BLOCK_BYTES
from tests.replies import entries_of


async def store(stub, ns: str, lid: int, tokens: list[int], fill: int = 1) -> pb.ReserveResponse:
    """Reserve, write and commit what fits; the Reserve answer."""
    res = await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=tokens))
    fresh = [e for e in entries_of(res) if e.status == pb.RESERVE_STATUS_RESERVED]

    async def writes():
        yield pb.WriteBlocksRequest(
            header=pb.WriteBlocksHeader(namespace_id=ns, lease_id=lid, commit=True)
        )
        for e in fresh:
            yield pb.WriteBlocksRequest(block=pb.BlockData(hash=e.hash, data=payload(e.hash, fill)))

    if fresh:
        await stub.WriteBlocks(writes())
    return res


def payload(block_hash: bytes, fill: int, size: int = BLOCK_BYTES) -> bytes:
    return (bytes([fill]) + block_hash[:7]) * (size // 8)


REAL_LAYOUT = pb.KVLayout(
    num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16"
)
"""256 KiB blocks: 256 to a default 64 MiB arena."""
