"""Chained prefix hashes: the key of every cached block.

A prompt is cut into blocks of ``block_size`` tokens; only full blocks get a
hash. Block *i* is keyed by::

    h_i = H(h_{i-1} || extra_i || tokens_i)          h_{-1} = root

so a block's hash covers every token before it: two prompts share block *i*
only when all their tokens up to the end of block *i* match.

Two schemes exist (`HashScheme`):

``kvstore-sha256-v1`` (the default)
    ``H`` is SHA-256 over a fixed byte encoding::

        parent (32 bytes) || u32le(len(extra)) || extra || tokens as u32le

    Tokens must lie in ``[0, 2**32)``. ``extra`` (LoRA name, multimodal item
    hashes: anything that changes the KV without changing tokens) is opaque
    bytes; ``None`` and ``b""`` are the same. The root is::

        SHA-256("kvstore/root/v1\\0" || u32le(len(ns)) || ns || u32le(len(salt)) || salt)

    where ``ns`` is the namespace digest (model + layout + scheme) and
    ``salt`` the tenant's secret salt, chosen by the server.

``vllm-sha256-cbor``
    Bit-compatible with vLLM's ``sha256_cbor`` prefix-cache hashes:
    ``SHA-256(canonical_cbor((parent, tuple(tokens), extra_keys)))`` with
    root ``SHA-256(canonical_cbor(seed))`` where ``seed`` is the
    ``PYTHONHASHSEED`` string vLLM runs with. ``extra_keys`` is ``None`` or a
    tuple of ints/strings/bytes. Tenant isolation then comes from the store's
    per-tenant scopes alone (the root cannot carry a salt and stay
    compatible).

The vLLM scheme's canonical CBOR lives in `kvstore.cbor`; ``cbor_encode``
is re-exported here. This module is the one implementation used by the server (requests that send
tokens) and by the client (requests that send hashes).
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Sequence
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from kvstore.cbor import UINT32_LIMIT, cbor_encode, cbor_head, encode_uints
from kvstore.errors import InvalidArgument
from kvstore.types import HASH_BYTES, BlockHash

ExtraKey = int | str | bytes
"""One element of a vLLM ``extra_keys`` tuple."""

Extra = bytes | tuple[ExtraKey, ...] | None
"""Per-block extra input: bytes for the default scheme, a tuple for vLLM's."""

Tokens = Sequence[int] | npt.NDArray[np.integer]
"""Token ids as a Python sequence or a 1-D integer array."""

_NATIVE_U32 = sys.byteorder == "little" and array.array("I").itemsize == 4
"""``array('I')`` holds little-endian uint32 here: its bytes are the wire form."""

_U32 = struct.Struct("<I")
_ROOT_TAG = b"kvstore/root/v1\0"
MAX_TOKEN = (1 << 32) - 1


class HashScheme(StrEnum):
    """How a chain of block hashes is computed."""

    KVSTORE_SHA256 = "kvstore-sha256-v1"
    VLLM_SHA256_CBOR = "vllm-sha256-cbor"


def kvstore_root(namespace_digest: bytes, salt: bytes = b"") -> BlockHash:
    """Root of the default scheme for one namespace and one tenant salt.

    Args:
        namespace_digest: `NamespaceSpec.digest()` of the namespace.
        salt: the tenant's secret salt (empty for a shared namespace).
    """
    h = hashlib.sha256(_ROOT_TAG)
    h.update(_U32.pack(len(namespace_digest)))
    h.update(namespace_digest)
    h.update(_U32.pack(len(salt)))
    h.update(salt)
    return BlockHash(h.digest())


def vllm_root(seed: str) -> BlockHash:
    """vLLM's ``NONE_HASH`` for a given ``PYTHONHASHSEED`` (sha256_cbor)."""
    return BlockHash(hashlib.sha256(cbor_encode(seed)).digest())


def token_bytes(tokens: Tokens) -> bytes:
    """Encode token ids as little-endian uint32, rejecting out-of-range ids.

    A list of ints (what a tokenizer returns) takes the fast path of
    ``array('I')``, which refuses ids out of range itself: 8192 ids in
    ~0.1 ms, where ``np.asarray`` of the list takes ~0.4 ms.
    """
    if isinstance(tokens, list):
        ids = _as_uint32(tokens)
        if ids is not None:
            return ids.tobytes()
        # else the array path below says what is wrong
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgument(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgument(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.uint32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN:
            raise InvalidArgument(f"token ids must lie in [0, 2**32), got range [{lo}, {hi}]")
    return arr.astype("<u4", copy=False).tobytes()


def _check_extras(extras: Sequence[Extra] | None, n_blocks: int) -> Sequence[Extra] | None:
    if extras is not None and len(extras) < n_blocks:
        raise InvalidArgument(f"got {len(extras)} extras for {n_blocks} full blocks")
    return extras


def hash_blocks(
    root: BlockHash,
    tokens: Tokens,
    block_size: int,
    *,
    scheme: HashScheme = HashScheme.KVSTORE_SHA256,
    extras: Sequence[Extra] | None = None,
) -> list[BlockHash]:
    """Chain hashes of every *full* block of ``tokens``.

    Args:
        root: `kvstore_root` or `vllm_root` of the namespace (and tenant).
        tokens: the prompt's token ids; a partial last block is ignored.
        block_size: tokens per block.
        scheme: which encoding and hash to use.
        extras: optional per-block extra input, one per full block.

    Returns:
        One 32-byte hash per full block, in order.
    """
    if block_size <= 0:
        raise InvalidArgument(f"block_size must be positive, got {block_size}")
    if len(root) != HASH_BYTES:
        raise InvalidArgument(f"root must be {HASH_BYTES} bytes, got {len(root)}")
    if scheme is HashScheme.VLLM_SHA256_CBOR:
        return _hash_blocks_vllm(root, tokens, block_size, extras)
    data = token_bytes(tokens)
    n_blocks = len(data) // (4 * block_size)
    extras = _check_extras(extras, n_blocks)
    stride = 4 * block_size
    view = memoryview(data)
    sha256 = hashlib.sha256
    no_extra = _U32.pack(0)
    parent: bytes = root
    out: list[BlockHash] = []
    append = out.append
    if extras is None:  # the hot path: no per-block branch, no concatenation
        for start in range(0, n_blocks * stride, stride):
            h = sha256(parent)
            h.update(no_extra)
            h.update(data[start : start + stride])
            parent = h.digest()
            append(parent)  # type: ignore[arg-type]
        return out
    for i in range(n_blocks):
        extra = extras[i] if extras is not None else None
        if extra:
            if not isinstance(extra, bytes):
                raise InvalidArgument("extras of the kvstore-sha256-v1 scheme must be bytes")
            h = sha256(parent)
            h.update(_U32.pack(len(extra)))
            h.update(extra)
            h.update(view[i * stride : (i + 1) * stride])
            parent = h.digest()
        else:
            parent = sha256(parent + no_extra + view[i * stride : (i + 1) * stride]).digest()
        append(BlockHash(parent))
    return out


def _as_uint32(tokens: list[int]) -> npt.NDArray[np.uint32] | None:
    """A list of ids in ``[0, 2**32)`` as a uint32 array (through ``array('I')``,
    several times faster than ``np.asarray`` of a list), else None."""
    if not _NATIVE_U32:
        return None
    try:
        return np.frombuffer(array.array("I", tokens), dtype=np.uint32)
    except (OverflowError, TypeError):
        return None


def _hash_blocks_vllm(
    root: BlockHash, tokens: Tokens, block_size: int, extras: Sequence[Extra] | None
) -> list[BlockHash]:
    ids = _as_uint32(tokens) if isinstance(tokens, list) else None
    if ids is None:
        ids = np.asarray(tokens)
    if ids.ndim != 1:
        raise InvalidArgument(f"tokens must be one-dimensional, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise InvalidArgument(f"tokens must be integers, got dtype {ids.dtype}")
    n_blocks = ids.size // block_size
    extras = _check_extras(extras, n_blocks)
    ids = ids[: n_blocks * block_size]
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= UINT32_LIMIT):
        return _hash_blocks_vllm_generic(root, ids.tolist(), block_size, extras)
    # The bytes hashed per block are, in canonical CBOR:
    #   0x83 | 0x58 0x20 parent | array head | each token | extra keys (0xf6 for None)
    # (a 3-array, a 32-byte string, an array of block_size uints, the keys).
    data, ends = encode_uints(ids)
    bounds: list[int] = [0, *ends[block_size - 1 :: block_size].tolist()]
    lead = b"\x83" + cbor_head(2, HASH_BYTES)
    array_head = cbor_head(4, block_size)
    sha256 = hashlib.sha256
    parent: bytes = root
    out: list[BlockHash] = []
    append = out.append
    # Every block's bytes start with ``lead``: hash it once, copy the state per block.
    base = sha256(lead)
    if extras is None:
        for i in range(n_blocks):
            h = base.copy()
            h.update(parent)
            h.update(array_head)
            h.update(data[bounds[i] : bounds[i + 1]])
            h.update(b"\xf6")
            parent = h.digest()
            append(parent)  # type: ignore[arg-type]
        return out
    last: object = None
    last_encoded = b"\xf6"
    for i in range(n_blocks):
        extra = extras[i]
        if extra is not last:  # runs share one tuple (a LoRA name): encode it once
            if extra is not None and not isinstance(extra, tuple):
                raise InvalidArgument(
                    "extras of the vllm-sha256-cbor scheme must be tuples or None"
                )
            last, last_encoded = extra, cbor_encode(extra)
        h = base.copy()
        h.update(parent)
        h.update(array_head)
        h.update(data[bounds[i] : bounds[i + 1]])
        h.update(last_encoded)
        parent = h.digest()
        append(parent)  # type: ignore[arg-type]
    return out


def _hash_blocks_vllm_generic(
    root: BlockHash, token_list: list[int], block_size: int, extras: Sequence[Extra] | None
) -> list[BlockHash]:
    """Token ids outside ``[0, 2**32)``: the general encoder, item by item (as vLLM would)."""
    parent: bytes = root
    out: list[BlockHash] = []
    for i in range(len(token_list) // block_size):
        extra = extras[i] if extras is not None else None
        if extra is not None and not isinstance(extra, tuple):
            raise InvalidArgument("extras of the vllm-sha256-cbor scheme must be tuples or None")
        encoded = cbor_encode(
            (parent, tuple(token_list[i * block_size : (i + 1) * block_size]), extra)
        )
        parent = hashlib.sha256(encoded).digest()
        out.append(BlockHash(parent))
    return out


__all__ = [
    "MAX_TOKEN",
    "Extra",
    "ExtraKey",
    "HashScheme",
    "Tokens",
    "cbor_encode",
    "hash_blocks",
    "kvstore_root",
    "token_bytes",
    "vllm_root",
]
