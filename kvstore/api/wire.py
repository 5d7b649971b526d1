"""Wire forms of the values both sides of the API exchange: layouts, hash schemes,
the packed forms of chains (docs/api.md, "Wire forms") and the tier of an event.

One module owns this mapping so that the client and the service cannot
drift apart. It imports the generated protobuf messages but not grpc.

Packed forms (the one wire form of each value): a chain of block hashes
travels as one ``bytes`` field, the 32-byte hashes concatenated; a Lookup's
slots, generations and checksums as little-endian uint64; QueryPrefix's
``packed_token_ids`` as little-endian uint32. One bytes field is parsed and
serialised by protobuf in one copy, where a repeated field costs a Python
object per item on each side.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from kvstore.errors import InvalidArgument
from kvstore.hashing import HashScheme, Tokens, token_bytes
from kvstore.layout import KVLayout
from kvstore.types import HASH_BYTES, BlockHash
from kvstore.v1 import kvstore_pb2 as pb

_HASH_DTYPE = np.dtype(f"V{HASH_BYTES}")
"""One opaque 32-byte item: `unpack_hashes` splits a packed field with it."""

TOKEN_BYTES = 4
"""Bytes of one token in a packed token field (little-endian uint32)."""

MAX_RELEASE_RUNS = 1024
"""Most ``runs`` one ``Release`` may carry (hits released in one call); a node
refuses more with INVALID_ARGUMENT before any work."""

_SCHEMES: dict[int, HashScheme] = {
    pb.HASH_SCHEME_UNSPECIFIED: HashScheme.KVSTORE_SHA256,
    pb.HASH_SCHEME_KVSTORE_SHA256: HashScheme.KVSTORE_SHA256,
    pb.HASH_SCHEME_VLLM_SHA256_CBOR: HashScheme.VLLM_SHA256_CBOR,
}
_SCHEME_PROTO: dict[HashScheme, pb.HashScheme.ValueType] = {
    HashScheme.KVSTORE_SHA256: pb.HASH_SCHEME_KVSTORE_SHA256,
    HashScheme.VLLM_SHA256_CBOR: pb.HASH_SCHEME_VLLM_SHA256_CBOR,
}


EVENT_TIER_MEMORY = "memory"
"""`Event.tier` of a node's pool; a block event with "" (from an older node) means the same."""

EVENT_TIER_DISK = "disk"
"""`Event.tier` of a node's disk tier (docs/disk.md)."""

_BLOCK_EVENTS = frozenset({pb.EVENT_KIND_STORED, pb.EVENT_KIND_REMOVED, pb.EVENT_KIND_CLEARED})


def event_tier(event: pb.Event) -> str:
    """Where ``event``'s blocks are: "memory" or "disk"; "" for a node joined / left.

    A node older than `Event.tier` sends "" on every event, and had only its pool.
    """
    if event.tier or event.kind not in _BLOCK_EVENTS:
        return event.tier
    return EVENT_TIER_MEMORY


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    """The wire form of a KV layout."""
    return pb.KVLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=layout.dtype,
        kv_order=layout.kv_order,
    )


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    """A `KVLayout` from its wire form; ``KVLayout`` validates the values.

    ``kv_order`` "" is the default order.
    """
    return KVLayout(
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        block_size=msg.block_size,
        dtype=msg.dtype,
        kv_order=msg.kv_order or "KV_LAYER_TOKEN_HEAD",
    )


def scheme_to_proto(scheme: HashScheme) -> pb.HashScheme.ValueType:
    """The enum value of a hash scheme."""
    return _SCHEME_PROTO[scheme]


def scheme_from_proto(value: int) -> HashScheme:
    """The hash scheme an enum value names (unspecified is the default scheme).

    Raises:
        InvalidArgument: the value names no scheme.
    """
    scheme = _SCHEMES.get(value)
    if scheme is None:
        raise InvalidArgument(f"unknown hash scheme {value}")
    return scheme


def pack_hashes(hashes: Iterable[bytes]) -> bytes:
    """``packed_hashes``: the hashes concatenated (each must be 32 bytes).

    Raises:
        InvalidArgument: a hash is not 32 bytes (it would shift every later one).
    """
    hashes = list(hashes)
    packed = b"".join(hashes)
    if len(packed) != HASH_BYTES * len(hashes):
        bad = next(i for i, h in enumerate(hashes) if len(h) != HASH_BYTES)
        raise InvalidArgument(
            f"hashes[{bad}] is {len(hashes[bad])} bytes; a block hash is {HASH_BYTES}"
        )
    return packed


def _check_whole(packed: bytes, field: str, item_bytes: int, items: str) -> None:
    """Raise `InvalidArgument` unless ``packed`` holds whole ``item_bytes``-byte items."""
    if len(packed) % item_bytes:
        raise InvalidArgument(
            f"{field} is {len(packed)} bytes, not a whole number of {item_bytes}-byte {items}"
        )


def unpack_hashes(packed: bytes, field: str = "packed_hashes") -> list[BlockHash]:
    """The 32-byte hashes of a ``packed_hashes`` field, in order.

    Raises:
        InvalidArgument: the length is not a multiple of 32 bytes.
    """
    _check_whole(packed, field, HASH_BYTES, "hashes")
    # A void dtype's tolist() gives one bytes object per item, NULs kept: 8 µs
    # for 512 hashes, where slicing in a loop takes 60 µs.
    hashes: list[BlockHash] = np.frombuffer(packed, dtype=_HASH_DTYPE).tolist()
    return hashes


def pack_tokens(tokens: Tokens) -> bytes:
    """Token ids as little-endian uint32, concatenated (`kvstore.hashing.token_bytes`).

    Raises:
        InvalidArgument: ids out of ``[0, 2**32)``, not integers, or not one-dimensional.
    """
    return token_bytes(tokens)


def unpack_tokens(packed: bytes, field: str = "packed_token_ids") -> npt.NDArray[np.uint32]:
    """The token ids of a packed token field (a read-only view of ``packed``).

    Raises:
        InvalidArgument: the length is not a multiple of 4 bytes.
    """
    _check_whole(packed, field, TOKEN_BYTES, "tokens")
    return np.frombuffer(packed, dtype="<u4").astype(np.uint32, copy=False)


U64_BYTES = 8
"""Bytes of one slot or generation in ``packed_slots`` / ``packed_generations``."""


def pack_u64(values: array[int]) -> bytes:
    """``packed_slots`` / ``packed_generations``: an ``array`` of 8-byte ints, little-endian.

    One copy of the array's buffer (byte-swapped first on a big-endian host).
    """
    if values.itemsize != U64_BYTES:
        raise ValueError(f"bug: pack_u64 of {values.itemsize}-byte items")
    if sys.byteorder == "little":
        return values.tobytes()
    swapped = array(values.typecode, values)
    swapped.byteswap()
    return swapped.tobytes()


def unpack_u64(packed: bytes, field: str) -> npt.NDArray[np.uint64]:
    """The values of a packed uint64 field (a read-only view of ``packed``).

    Raises:
        InvalidArgument: the length is not a multiple of 8 bytes.
    """
    _check_whole(packed, field, U64_BYTES, "integers")
    return np.frombuffer(packed, dtype="<u8").astype(np.uint64, copy=False)
