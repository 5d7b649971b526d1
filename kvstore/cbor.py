"""Canonical CBOR (RFC 8949 §4.2.1) for the few types vLLM hashes.

Two encoders, one set of bytes:

* `cbor_encode`: the general one, for None, bool, int, str, bytes and
  tuples/lists of them (roots, extra keys, the reference for tests).
* `encode_uints`: the hot path of the ``vllm-sha256-cbor`` scheme. Every
  block hashes ``(parent, tuple(tokens), extra_keys)``; the token array is
  nearly all of those bytes, so all the tokens of a chain are encoded at
  once, vectorised per head width with numpy, and each block then takes its
  slice. Python's per-token work (a call per int in `cbor_encode`, in
  cbor2 too) is what made the scheme 3-4x slower than cbor2 + hashlib.

Both match ``cbor2.dumps(value, canonical=True)`` (the tests check it, for
random tokens and the width boundaries 23/24, 255/256, 65535/65536).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvstore.errors import InvalidArgument

UINT32_LIMIT = 1 << 32
"""`encode_uints` takes values below this (token ids; 1, 2, 3 or 5 bytes each)."""


def cbor_head(major: int, value: int) -> bytes:
    """The head of a data item: major type and argument, in its shortest form."""
    if value < 24:
        return bytes((major << 5 | value,))
    if value < 1 << 8:
        return bytes((major << 5 | 24, value))
    if value < 1 << 16:
        return bytes((major << 5 | 25,)) + value.to_bytes(2, "big")
    if value < 1 << 32:
        return bytes((major << 5 | 26,)) + value.to_bytes(4, "big")
    if value < 1 << 64:
        return bytes((major << 5 | 27,)) + value.to_bytes(8, "big")
    raise InvalidArgument(f"integer {value} does not fit CBOR's 64-bit heads")


def cbor_encode(value: object) -> bytes:
    """Canonical CBOR of None, bool, int, str, bytes and tuples/lists of them.

    Matches ``cbor2.dumps(value, canonical=True)`` for these types (the
    tests check it against cbor2); anything else is an `InvalidArgument`.
    """
    out = bytearray()
    _cbor_into(out, value)
    return bytes(out)


def _cbor_into(out: bytearray, value: object) -> None:
    if value is None:
        out.append(0xF6)
    elif value is True:
        out.append(0xF5)
    elif value is False:
        out.append(0xF4)
    elif isinstance(value, int):
        if value >= 0:
            out += cbor_head(0, value)
        else:
            out += cbor_head(1, -1 - value)
    elif isinstance(value, bytes):
        out += cbor_head(2, len(value))
        out += value
    elif isinstance(value, str):
        encoded = value.encode("utf-8")
        out += cbor_head(3, len(encoded))
        out += encoded
    elif isinstance(value, (tuple, list)):
        out += cbor_head(4, len(value))
        for item in value:
            _cbor_into(out, item)
    else:
        raise InvalidArgument(f"cannot CBOR-encode {type(value).__name__} for a block hash")


def encode_uints(values: npt.NDArray[np.integer]) -> tuple[bytes, npt.NDArray[np.int64]]:
    """Each value's canonical CBOR, concatenated, and where each one ends.

    Args:
        values: a 1-D integer array, every value in ``[0, 2**32)`` (the
            caller checks the range: anything else is a bug here).

    Returns:
        ``(data, ends)``: ``data[ends[i-1]:ends[i]]`` (``0`` for ``i = 0``)
        is ``cbor_encode(int(values[i]))``.
    """
    v = values.astype(np.uint32, copy=False)
    width = np.full(v.shape, 5, dtype=np.int64)  # 0x1a + 4 bytes
    width[v < 1 << 16] = 3  # 0x19 + 2 bytes
    width[v < 1 << 8] = 2  # 0x18 + 1 byte
    width[v < 24] = 1  # the value is the head
    ends = np.cumsum(width)
    if not ends.size:
        return b"", ends
    starts = ends - width
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    for size, head in ((1, None), (2, 0x18), (3, 0x19), (5, 0x1A)):
        where = width == size
        at = starts[where]
        if not at.size:
            continue
        picked = v[where]
        if head is None:
            out[at] = picked
            continue
        out[at] = head
        for k in range(size - 1):  # big-endian argument bytes
            shift = 8 * (size - 2 - k)
            out[at + 1 + k] = (picked >> shift) & 0xFF
    return out.tobytes(), ends
