"""ReadBlocks and WriteBlocks: block bytes over gRPC, for runners that cannot map the pool.

Every read or write is checked against the store right before it touches
the pool, in the same synchronous step (no ``await`` in between): a block is
read only while this lease pins it, and written only while it is WRITING
under this lease, so a lease that expires mid-stream can never make us
touch a slot that has since been handed to someone else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from kvstore.checksum import NOT_COMPUTED, block_checksum
from kvstore.results import BlockRef
from kvstore.types import BlockHash, LeaseId, SlotId
from kvstore.v1 import kvstore_pb2 as pb
from service.api import validate
from service.api.base import ServicerBase
from service.api.decode import Context
from service.api.errors import FieldError, guard_stream_in, guard_stream_out
from service.api.offload import off_loop


def _refs(blocks: Sequence[pb.BlockRef]) -> list[BlockRef]:
    """The blocks a ReadBlocks request names, checked (pure: may run off the loop)."""
    return [
        BlockRef(validate.block_hash(b.hash, f"blocks[{i}].hash"), SlotId(b.slot), b.generation)
        for i, b in enumerate(blocks)
    ]


class DataRpcs(ServicerBase):
    """The byte-streaming RPCs of the KVStore service."""

    @guard_stream_out("ReadBlocks")
    async def ReadBlocks(
        self, request: pb.ReadBlocksRequest, context: Context
    ) -> AsyncIterator[pb.BlockData]:
        """Stream the bytes of blocks pinned under the lease."""
        node = self.node
        tenant = node.tenant(context)
        namespace = self.namespace(request.namespace_id, tenant)
        lease_id = validate.lease_id(request.lease_id)
        if not request.blocks:
            raise FieldError("blocks", "is empty; name at least one block")
        if len(request.blocks) > node.config.max_chain_blocks:
            raise FieldError(
                "blocks",
                f"names {len(request.blocks)} blocks, at most"
                f" {node.config.max_chain_blocks} per call (max_chain_blocks)",
            )
        refs = await off_loop(len(request.blocks), _refs, request.blocks)
        pool = node.pool(namespace)
        for ref in refs:
            # Checked right before each read: the lease may expire mid-stream.
            slot = node.store.pinned_slot(namespace, tenant, lease_id, ref, node.now())
            yield pb.BlockData(hash=ref.hash, data=pool.read(slot))

    @guard_stream_in("WriteBlocks")
    async def WriteBlocks(
        self, request_iterator: AsyncIterator[pb.WriteBlocksRequest], context: Context
    ) -> pb.WriteBlocksResponse:
        """Write reserved blocks' bytes; commit them at the end if the header says so."""
        node = self.node
        tenant = node.tenant(context)
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        if first is None or first.WhichOneof("item") != "header":
            raise FieldError("header", "the first WriteBlocks message must be a header")
        header = first.header
        namespace = self.namespace(header.namespace_id, tenant)
        lease_id: LeaseId = validate.lease_id(header.lease_id, "header.lease_id")
        pool = node.pool(namespace)
        block_bytes = pool.descriptor.block_bytes
        written: dict[BlockHash, int] = {}  # hash -> its writer's checksum
        async for message in messages:
            if message.WhichOneof("item") != "block":
                raise FieldError("header", "only the first WriteBlocks message may be a header")
            item = message.block
            hash_ = validate.block_hash(item.hash, "block.hash")
            if len(item.data) != block_bytes:
                raise FieldError(
                    "block.data",
                    f"a block of this namespace is {block_bytes} bytes, got {len(item.data)}",
                )
            if len(written) >= node.config.max_chain_blocks:
                raise FieldError(
                    "block",
                    f"at most {node.config.max_chain_blocks} blocks a call (max_chain_blocks)",
                )
            # The checksum of the bytes as received (the source, never the slot
            # after the write): kept even when the writer sent none.
            received = block_checksum(item.data)
            if item.checksum not in (NOT_COMPUTED, received):
                raise FieldError(
                    "block.checksum",
                    f"block {hash_.hex()[:16]}'s data does not have the checksum sent with it",
                )
            slot = node.store.writing_slot(namespace, tenant, lease_id, hash_, node.now())
            pool.write(slot, item.data)
            written[hash_] = received
        committed = 0
        if header.commit and written:
            committed = node.commit(
                namespace, tenant, lease_id, list(written), checksums=list(written.values())
            )
        return pb.WriteBlocksResponse(written=len(written), committed=committed)
