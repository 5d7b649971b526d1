"""Protobuf messages ↔ kvstore value objects, for the client side.

The service has its own translation (``service/api/translate.py``); the client
keeps its own so that the SDK depends on nothing in ``service``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypedDict, overload

from kvstore.api import wire
from kvstore.api.wire import pack_hashes, unpack_hashes
from kvstore.client.handles import Namespace
from kvstore.client.hit import Hit
from kvstore.errors import InvalidArgument
from kvstore.hashing import Extra, Tokens
from kvstore.pool import ArenaSpec, PoolDescriptor
from kvstore.results import MissReason
from kvstore.types import HASH_BYTES, BlockHash, LeaseId, NamespaceId, SlotId
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
                stamp_path=a.stamp_path,
            )
            for a in msg.arenas
        ),
        device=msg.device or "cpu",
        version=msg.pool_version,
    )


class ChainFields(TypedDict, total=False):
    """The fields that name a chain in a Lookup or a Reserve (one wire form of it)."""

    tokens: list[int]
    packed_hashes: bytes
    extras: list[bytes]


class LookupChainFields(ChainFields, total=False):
    """A Lookup's chain fields: a chain hashed here says how many tokens it was."""

    query_tokens: int


def chain_fields(
    tokens: Tokens | None, hashes: Sequence[bytes] | None, extras: Sequence[Extra] | None
) -> ChainFields:
    """The chain fields of a Lookup or Reserve request (docs/api.md, "Wire forms").

    ``packed_hashes`` (one bytes field), or ``tokens`` with their ``extras``
    for the node to hash.

    Raises:
        InvalidArgument: neither or both of tokens and hashes, bad token ids,
            or extras that are not bytes.
    """
    if (tokens is None) == (hashes is None):
        raise InvalidArgument("give exactly one of tokens or hashes")
    fields = ChainFields()
    if tokens is not None:
        # Checked and made uint32 as the node will read them (ids in [0, 2**32)).
        fields["tokens"] = wire.unpack_tokens(wire.pack_tokens(tokens)).tolist()
    else:
        fields["packed_hashes"] = pack_hashes(hashes or ())
    if extras is not None:
        if not all(e is None or isinstance(e, bytes) for e in extras):
            raise InvalidArgument("extras sent to the node must be bytes (or None)")
        fields["extras"] = [e if isinstance(e, bytes) else b"" for e in extras]
    return fields


@overload
def request_fields(
    ns: Namespace,
    tokens: Tokens | None,
    hashes: Sequence[bytes] | None,
    extras: Sequence[Extra] | None,
    *,
    query_tokens: Literal[True],
) -> LookupChainFields: ...
@overload
def request_fields(
    ns: Namespace,
    tokens: Tokens | None,
    hashes: Sequence[bytes] | None,
    extras: Sequence[Extra] | None,
    *,
    query_tokens: Literal[False],
) -> ChainFields: ...
def request_fields(
    ns: Namespace,
    tokens: Tokens | None,
    hashes: Sequence[bytes] | None,
    extras: Sequence[Extra] | None,
    *,
    query_tokens: bool,
) -> ChainFields | LookupChainFields:
    """The chain fields a Lookup (``query_tokens``) or a Reserve sends.

    A prompt is hashed in this process (under the namespace's ``chain_root``,
    as the node would) and sent as its chain: the hashing then runs in the
    runner processes, in parallel, not in the node's one event loop, and
    the request is half the bytes. A Lookup adds ``query_tokens``, how many
    tokens that was, for the node's token counters. `chain_fields` says
    what to send otherwise: hashes given, extras given (sent as they are),
    or no full block. Call it after `NodeSession.ensure_ready`: a node
    restart may have changed the root.

    Raises:
        InvalidArgument: neither or both of tokens and hashes, bad token ids.
    """
    if tokens is not None and hashes is None and extras is None and ns.chain_root:
        chain = ns.hash(tokens)
        if chain:
            fields = LookupChainFields(packed_hashes=b"".join(chain))
            if query_tokens:
                fields["query_tokens"] = len(tokens)
            return fields
    return chain_fields(tokens, hashes, extras)


def hit_from_proto(
    ns: Namespace, resp: pb.LookupResponse, lease_generation: int, lease_id: LeaseId
) -> Hit:
    """A `Hit` of a Lookup response, bound to the namespace's current mapping.

    The reply is kept as it came: the hashes as one bytes object, slots,
    generations and checksums as arrays (views of the reply's bytes); `Hit`
    builds per-block locations only if they are asked for.

    ``lease_id`` is the lease the Lookup was sent with: a pinned hit is
    released under it, never under a lease that replaced it.

    Raises:
        InvalidArgument: the reply's packed fields do not agree in length.
    """
    slots = wire.unpack_u64(resp.packed_slots, "packed_slots")
    generations = wire.unpack_u64(resp.packed_generations, "packed_generations")
    checksums = wire.unpack_u64(resp.packed_checksums, "packed_checksums")
    n = len(slots)
    if len(resp.hit_hashes) != HASH_BYTES * n or len(generations) != n or len(checksums) != n:
        raise InvalidArgument(
            f"the node's Lookup reply is inconsistent: {len(resp.hit_hashes)} bytes of "
            f"hashes, {n} slots, {len(generations)} generations, {len(checksums)} checksums"
        )
    return Hit(
        namespace=ns,
        hit_hashes=resp.hit_hashes,
        slots=slots,
        generations=generations,
        checksums=checksums,
        packed_chain=resp.packed_chain,
        slots_per_arena=resp.slots_per_arena,
        block_bytes=resp.block_bytes,
        hit_tokens=resp.hit_tokens,
        query_tokens=resp.query_tokens,
        pinned=resp.pinned,
        miss_reason=MissReason(resp.miss_reason),
        epoch=resp.pool_epoch,
        mapping=ns.mapping,
        lease_generation=lease_generation,
        lease_id=lease_id if resp.pinned else None,
        pool_version=resp.pool_version,
    )


@dataclass(frozen=True)
class Reservation:
    """A Reserve reply: entry i's hash, status and slot.

    ``slots[i]`` is meaningful for RESERVED and HIT entries only.
    ``reserved`` lists the indexes of the RESERVED entries, in chain order.
    """

    hashes: list[BlockHash]
    statuses: Sequence[int]
    slots: list[SlotId]
    epoch: int
    version: int
    reserved: list[int]
    slots_per_arena: int
    """Of the node's pool: slot s is in arena s // slots_per_arena."""
    block_bytes: int
    """Of the node's pool: slot s is at byte (s % slots_per_arena) * block_bytes."""

    def packed_reserved(self) -> bytes:
        """The RESERVED entries' hashes, concatenated (what Commit or Abort sends)."""
        return b"".join([self.hashes[i] for i in self.reserved])


def reservation_from_proto(resp: pb.ReserveResponse) -> Reservation:
    """The entries of a Reserve reply.

    Raises:
        InvalidArgument: the reply's fields do not agree in length.
    """
    statuses = list(resp.statuses)
    n = len(statuses)
    if len(resp.hashes) != HASH_BYTES * n or len(resp.slots) != n:
        raise InvalidArgument(
            f"the node's Reserve reply is inconsistent: {len(resp.hashes)} bytes of "
            f"hashes, {n} statuses, {len(resp.slots)} slots"
        )
    return Reservation(
        hashes=unpack_hashes(resp.hashes, "hashes"),
        statuses=statuses,
        slots=list(resp.slots),  # type: ignore[arg-type]
        epoch=resp.pool_epoch,
        version=resp.pool_version,
        reserved=[i for i, s in enumerate(statuses) if s == pb.RESERVE_STATUS_RESERVED],
        slots_per_arena=resp.slots_per_arena,
        block_bytes=resp.block_bytes,
    )
