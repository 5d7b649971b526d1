"""Checks of request fields, before anything reaches the store.

Each check returns the domain value or raises `FieldError` naming the field
and saying what was wrong, which the error guard sends as
``INVALID_ARGUMENT`` with a ``BadRequest`` field violation.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence
from typing import cast

import numpy as np

from kvstore import checksum
from kvstore.errors import InvalidArgument
from kvstore.types import HASH_BYTES, BlockHash, LeaseId, NamespaceId
from service.api.errors import FieldError

_NAMESPACE_RE = re.compile(r"^[0-9a-f]{16}$")

DEFAULT_PAGE_SIZE = 100
"""Blocks per ListBlocks page when the request says 0."""

MAX_PAGE_SIZE = 1000
"""Most blocks one ListBlocks page may hold."""


def namespace_id(value: str, field: str = "namespace_id") -> NamespaceId:
    """A well-formed namespace id (16 lowercase hex characters, from RegisterNamespace)."""
    if not value:
        raise FieldError(field, "is required (RegisterNamespace returns it)")
    if not _NAMESPACE_RE.match(value):
        raise FieldError(field, f"{value[:40]!r} is not a namespace id (16 lowercase hex digits)")
    return NamespaceId(value)


def lease_id(value: int, field: str = "lease_id") -> LeaseId:
    """A nonzero lease id (from OpenLease)."""
    if value == 0:
        raise FieldError(field, "is required (OpenLease returns one)")
    return LeaseId(value)


def block_hash(value: bytes, field: str) -> BlockHash:
    """One 32-byte block hash."""
    if len(value) != HASH_BYTES:
        raise FieldError(field, f"a block hash is {HASH_BYTES} bytes, got {len(value)}")
    return BlockHash(value)


def checksums(
    packed: bytes, count: int, required: bool, field: str = "packed_checksums"
) -> array[int]:
    """Per-block checksums packed as little-endian uint64, one per named hash (or none).

    ``required`` (a host pool, `PoolDescriptor.checksummed`): every block needs
    one, never `checksum.NOT_COMPUTED`. A writer that could leave it out would
    turn every reader's check off for its blocks (issue 40, item 3).
    """
    try:
        values = checksum.unpack_checksums(packed, count)
    except InvalidArgument as exc:
        raise FieldError(field, str(exc).removeprefix(f"{field} ")) from None
    missing = checksum.first_missing(values) if required else None
    if missing is not None:
        raise FieldError(
            field,
            f"block {missing} has no checksum: a host pool's writer sends the xxh3-64 of "
            "every block it wrote (kvstore.checksum), none 0",
        )
    return values


def block_hashes(
    values: Sequence[bytes], max_blocks: int, field: str = "hashes", *, required: bool = True
) -> list[BlockHash]:
    """A bounded list of 32-byte hashes; empty only when not ``required``."""
    if required and not values:
        raise FieldError(field, "is empty; name at least one block")
    if len(values) > max_blocks:
        raise FieldError(
            field, f"names {len(values)} blocks, at most {max_blocks} per call (max_chain_blocks)"
        )
    hashes = list(values)
    for i, value in enumerate(hashes):  # hot path: no per-item call or string
        if len(value) != HASH_BYTES:
            block_hash(value, f"{field}[{i}]")  # raises with the field named
    return cast(list[BlockHash], hashes)


def chain_source(
    tokens: Sequence[int] | np.ndarray,
    hashes: Sequence[bytes],
    extras: Sequence[bytes],
    max_tokens: int,
    max_blocks: int,
    block_size: int,
) -> str:
    """Which of ``tokens`` / ``hashes`` a chain request uses: exactly one, bounded.

    At most ``max_tokens`` tokens (``max_request_tokens``) and no more than
    ``max_blocks`` (``max_chain_blocks``) blocks of them; at most one extra
    per block. The hashes are bounded by `block_hashes`.

    Returns:
        ``"tokens"`` or ``"hashes"``.
    """
    # len(), not truth: tokens may be a numpy array (QueryPrefix's packed_token_ids).
    if len(tokens) and len(hashes):
        raise FieldError("tokens", "send either tokens or hashes, not both")
    if not len(tokens) and not len(hashes):
        raise FieldError("tokens", "send either tokens or hashes; both are empty")
    if len(hashes) and extras:
        raise FieldError("extras", "extras go with tokens; hashes already include them")
    if len(tokens) > max_tokens:
        raise FieldError(
            "tokens", f"{len(tokens)} tokens, at most {max_tokens} per call (max_request_tokens)"
        )
    if len(tokens) // block_size > max_blocks:  # a trailing partial block is not hashed
        raise FieldError(
            "tokens",
            f"{len(tokens)} tokens are {len(tokens) // block_size} full blocks, at most"
            f" {max_blocks} per call (max_chain_blocks)",
        )
    if len(extras) > max_blocks:
        raise FieldError(
            "extras", f"{len(extras)} extras, at most {max_blocks} per call (max_chain_blocks)"
        )
    return "tokens" if len(tokens) else "hashes"


MAX_PAGE_TOKEN_DIGITS = 18
"""Digits of the offset in a page token (so offset + page size fits in an int64)."""


def page_size(value: int) -> int:
    """ListBlocks page size: 0 means the default, at most `MAX_PAGE_SIZE`."""
    if value > MAX_PAGE_SIZE:
        raise FieldError("page_size", f"{value} is over the maximum of {MAX_PAGE_SIZE}")
    return value or DEFAULT_PAGE_SIZE


def page_offset(token: str) -> int:
    """The offset an opaque ListBlocks page token stands for ("" = first page)."""
    if not token:
        return 0
    digits = token[1:]
    # isdigit() alone accepts "²" and other Unicode digits that int() refuses,
    # and int() of thousands of digits is slow (and refused past 4300).
    if (
        not token.startswith("o")
        or not 0 < len(digits) <= MAX_PAGE_TOKEN_DIGITS
        or not (digits.isascii() and digits.isdigit())
    ):
        raise FieldError("page_token", "is not a token from a previous ListBlocks page")
    return int(digits)


def page_token(offset: int) -> str:
    """The opaque token of the page starting at ``offset``."""
    return f"o{offset}"


def ttl(value: float, default: float, maximum: float) -> float:
    """A lease TTL: 0 means ``default``; otherwise in (0, ``maximum``]."""
    if value == 0:
        return default
    if not 0 < value <= maximum:
        raise FieldError("ttl_seconds", f"must be in (0, {maximum}] seconds, got {value}")
    return value
