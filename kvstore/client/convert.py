"""Protobuf messages ↔ kvstore value objects, for the client side.

The service has its own translation (``service/api/convert.py``); the client
keeps its own so that the SDK depends on nothing in ``service``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.client.handles import BlockLocation, Hit, Namespace
from kvstore.errors import InvalidArgument
from kvstore.hashing import Extra, Tokens, token_bytes
from kvstore.pool import ArenaSpec, PoolDescriptor
from kvstore.results import MissReason
from kvstore.types import BlockHash, LeaseId, NamespaceId, SlotId
from kvstore.v1 import kvstore_pb2 as pb


def descriptor_from_proto(msg: pb.AttachPoolResponse) -> PoolDescriptor:
    """The `PoolDescriptor` an ``AttachPool`` response describes."""
    return PoolDescriptor(
        kind=msg.kind,
        epoch=msg.pool_epoch,
        namespace=NamespaceId(msg.namespace_id),
        block_bytes=msg.block_bytes,
        capacity=msg.capacity_blocks,
        slots_per_arena=msg.slots_per_arena,
        arenas=tuple(
            ArenaSpec(
                index=a.index,
                size_bytes=a.size_bytes,
                path=a.path,
                cuda_ipc_handle=a.cuda_ipc_handle,
            )
            for a in msg.arenas
        ),
        device=msg.device or "cpu",
        version=msg.pool_version,
    )


def chain_fields(
    tokens: Tokens | None, hashes: Sequence[bytes] | None, extras: Sequence[Extra] | None
) -> dict[str, Any]:
    """The ``tokens`` / ``hashes`` / ``extras`` fields of a Lookup or Reserve request.

    Raises:
        InvalidArgument: neither or both of tokens and hashes, bad token ids,
            or extras that are not bytes.
    """
    if (tokens is None) == (hashes is None):
        raise InvalidArgument("give exactly one of tokens or hashes")
    fields: dict[str, Any] = {}
    if tokens is not None:
        fields["tokens"] = memoryview(token_bytes(tokens)).cast("I").tolist()
    else:
        fields["hashes"] = list(hashes or ())
    if extras is not None:
        if not all(e is None or isinstance(e, bytes) for e in extras):
            raise InvalidArgument("extras sent to the node must be bytes (or None)")
        fields["extras"] = [e or b"" for e in extras]
    return fields


def location_from_proto(msg: pb.BlockLocation) -> BlockLocation:
    """Where one block is."""
    return BlockLocation(
        BlockHash(msg.hash), SlotId(msg.slot), msg.generation, msg.arena, msg.offset
    )


def hit_from_proto(
    ns: Namespace, resp: pb.LookupResponse, lease_generation: int, lease_id: LeaseId
) -> Hit:
    """A `Hit` of a Lookup response, bound to the namespace's current mapping.

    ``lease_id`` is the lease the Lookup was sent with: a pinned hit is
    released under it, never under a lease that replaced it.
    """
    return Hit(
        namespace=ns,
        blocks=tuple(location_from_proto(b) for b in resp.blocks),
        hit_tokens=resp.hit_tokens,
        query_tokens=resp.query_tokens,
        pinned=resp.pinned,
        miss_reason=MissReason(resp.miss_reason),
        epoch=resp.pool_epoch,
        chain=tuple(BlockHash(h) for h in resp.chain),
        mapping=ns.mapping,
        lease_generation=lease_generation,
        lease_id=lease_id if resp.pinned else None,
        pool_version=resp.pool_version,
    )
