"""Block checksums: xxh3-64 of the bytes a block's writer wrote.

The one module that computes, packs and compares block checksums. A
checksum is an unsigned 64-bit xxh3 digest (the maintained ``xxhash``
package: ~10-20 GB/s on one core, several times a ``memcpy`` of the same
bytes, see ``benchmarks/bench_checksum.py``) of a block's bytes exactly as
they lie in its slot. 0 is reserved for "not computed" (a writer that sent
none, a CUDA pool): a real digest of 0 is stored as 1, so a 0 never claims
to have been checked. Buffers are read in place (the buffer protocol:
``bytes``, ``memoryview``, C-contiguous numpy arrays): no copy.

xxh3 is a checksum, not a MAC: it catches torn, stale, misdirected and
bit-flipped bytes, not a peer that lies on purpose (peers are trusted by
the cluster token, docs/security.md).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import xxhash

from kvstore.errors import InvalidArgument

if TYPE_CHECKING:  # typeshed's name for "any object with the buffer protocol"
    from _typeshed import ReadableBuffer

NOT_COMPUTED = 0
"""The checksum of a block whose writer computed none: nothing to check it against."""

CHECKSUM_BYTES = 8
"""Bytes per checksum in a packed field (little-endian uint64)."""

_digest = xxhash.xxh3_64_intdigest


def block_checksum(data: ReadableBuffer) -> int:
    """The checksum of one block's bytes (any C-contiguous buffer), never 0."""
    return _digest(data) or 1


def block_checksums(buffers: Iterable[ReadableBuffer]) -> array[int]:
    """The checksums of many blocks, in order, as an ``array('Q')``."""
    digest = _digest
    return array("Q", [digest(b) or 1 for b in buffers])


def pack_checksums(values: Sequence[int]) -> bytes:
    """``packed_checksums``: each value as a little-endian uint64, concatenated."""
    packed = values if isinstance(values, array) and values.typecode == "Q" else array("Q", values)
    if sys.byteorder != "little":
        packed = array("Q", packed)
        packed.byteswap()
    return packed.tobytes()


def unpack_checksums(packed: bytes, count: int, field: str = "packed_checksums") -> array[int]:
    """The checksums of a packed field that names ``count`` blocks; empty: all `NOT_COMPUTED`.

    Raises:
        InvalidArgument: the field is neither empty nor ``8 * count`` bytes.
    """
    if not packed:
        return array("Q", bytes(CHECKSUM_BYTES * count))
    if len(packed) != CHECKSUM_BYTES * count:
        raise InvalidArgument(
            f"{field} is {len(packed)} bytes: {count} blocks need {CHECKSUM_BYTES * count} "
            f"({CHECKSUM_BYTES} per block, in hash order) or none"
        )
    values = array("Q", packed)
    if sys.byteorder != "little":
        values.byteswap()
    return values


def first_missing(values: Sequence[int]) -> int | None:
    """The index of the first `NOT_COMPUTED` value (a block sent without a checksum), or None."""
    for i, value in enumerate(values):
        if value == NOT_COMPUTED:
            return i
    return None


def matches(data: ReadableBuffer, expected: int) -> bool:
    """True unless ``expected`` is a computed checksum that ``data`` does not have."""
    return expected == NOT_COMPUTED or block_checksum(data) == expected


def mismatches(buffers: Iterable[ReadableBuffer], expected: Iterable[int]) -> list[int]:
    """Indices of the blocks whose bytes do not have their expected checksum.

    A block expected with `NOT_COMPUTED` is not checked (never listed).
    """
    digest = _digest
    return [
        i
        for i, (data, want) in enumerate(zip(buffers, expected, strict=True))
        if want != NOT_COMPUTED and (digest(data) or 1) != want
    ]
