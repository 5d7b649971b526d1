"""The chain of block hashes a Lookup or Reserve names, computed off the event loop.

A request sends either the hashes (``packed_hashes``) or the tokens (the node
then hashes them with the namespace's scheme under the tenant's root), each in
its one wire form (`request_chain`; docs/api.md, "Wire forms"). Both are
bounded before any work: at most ``max_chain_blocks`` hashes, at most
``max_request_tokens`` tokens (and no more than ``max_chain_blocks`` blocks
of them). Hashing runs on a worker thread (`service.api.offload`), so the
loop keeps serving.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from kvstore.api import wire
from kvstore.errors import InvalidArgument
from kvstore.hashing import HashScheme, hash_blocks
from kvstore.types import HASH_BYTES, BlockHash
from kvstore.v1 import kvstore_pb2 as pb
from service.api import validate
from service.api.errors import FieldError
from service.api.offload import off_loop

TOKENS_PER_ITEM = 16
"""Tokens that count as one item of `off_loop` work when a chain is hashed.

Hashing costs about what 16 tokens (one typical block) do per item: up to
8192 tokens (~0.3 ms of SHA-256) hash inline. Handing them to a worker
thread gains nothing (hashlib keeps the GIL for inputs this small) and under
load the loop then waits for the GIL handoff, which costs more than the
hashing."""

Tokens = Sequence[int] | np.ndarray
"""A request's tokens: its repeated field (or an array of them)."""

ChainRequest = pb.LookupRequest | pb.ReserveRequest
"""A request that names a chain by tokens or by hashes."""
HashesRequest = ChainRequest | pb.CommitRequest | pb.AbortRequest | pb.ReleaseRequest
"""A request with ``packed_hashes``."""

T = TypeVar("T")


def token_array(tokens: Tokens) -> np.ndarray:
    """``tokens`` (a protobuf repeated field, or an array) as a uint32 array.

    One ``np.array`` call reads a repeated field in C: 8192 tokens in ~30 µs,
    the most a request may send (262144) in ~0.5 ms, where ``np.fromiter``
    or copying slices took ~0.5 ms for 8192 and 17 ms for 262144.
    """
    return np.array(tokens, dtype=np.uint32)


def request_chain(request: ChainRequest, max_blocks: int) -> tuple[Tokens, list[BlockHash]]:
    """The (tokens, hashes) of a Lookup or Reserve: its ``tokens`` and unpacked ``packed_hashes``.

    Raises:
        FieldError: ``packed_hashes`` not a whole number of 32-byte hashes, or
            over ``max_blocks`` of them.
    """
    return request.tokens, packed_hashes(request, max_blocks)


def packed_hashes(request: HashesRequest, max_blocks: int) -> list[BlockHash]:
    """The hashes of a request's ``packed_hashes`` (32 bytes each, at most ``max_blocks``).

    Raises:
        FieldError: a length that is not a multiple of 32, over ``max_blocks`` hashes.
    """
    packed = request.packed_hashes
    count = len(packed) // HASH_BYTES
    if count > max_blocks:
        raise FieldError(
            "packed_hashes",
            f"names {count} blocks, at most {max_blocks} per call (max_chain_blocks)",
        )
    return unpacked(wire.unpack_hashes, packed, "packed_hashes")


def named_hashes(request: HashesRequest, max_blocks: int) -> list[BlockHash]:
    """The blocks a Commit, Abort or Release names: its ``packed_hashes``, at least one.

    Raises:
        FieldError: none named, or `packed_hashes`' errors.
    """
    hashes = packed_hashes(request, max_blocks)
    if not hashes:
        raise FieldError("packed_hashes", "is empty; name at least one block")
    return hashes


def corrupt_hashes(request: pb.ReleaseRequest, max_blocks: int) -> list[BlockHash]:
    """A Release's ``packed_corrupt`` (32 bytes each, at most ``max_blocks``; may be empty).

    Raises:
        FieldError: a length that is not a multiple of 32, over ``max_blocks`` hashes.
    """
    packed = request.packed_corrupt
    if len(packed) // HASH_BYTES > max_blocks:
        raise FieldError(
            "packed_corrupt",
            f"names {len(packed) // HASH_BYTES} blocks, at most {max_blocks} (max_chain_blocks)",
        )
    return unpacked(wire.unpack_hashes, packed, "packed_corrupt")


def hashed_from(
    query_tokens: int, chain: Sequence[bytes], from_tokens: bool, block_size: int
) -> int:
    """A Lookup's ``query_tokens`` (hashes sent): the tokens its chain was hashed from.

    Raises:
        FieldError: sent with tokens, or not within a block of the chain's tokens.
    """
    if from_tokens:
        raise FieldError("query_tokens", "is for hashes only; tokens are counted as sent")
    full = len(chain) * block_size
    if not full <= query_tokens < full + block_size:
        raise FieldError(
            "query_tokens",
            f"{query_tokens} tokens cannot give {len(chain)} full blocks of {block_size}",
        )
    return query_tokens


def release_runs(request: pb.ReleaseRequest, max_blocks: int) -> list[int]:
    """A Release's ``runs``: how many of its hashes each hit released in it has.

    Checked before any work and before the hashes are unpacked: at most
    `wire.MAX_RELEASE_RUNS` runs, no more runs than hashes, none empty, none
    over ``max_blocks``. Each run costs one release on the loop, so a request
    of a million empty runs (1 MB) once held the loop for a second or more.

    Raises:
        FieldError: too many runs, an empty run, a run over ``max_blocks``
            (``max_chain_blocks``), or runs that do not add up to the hashes sent.
    """
    runs = list(request.runs[: wire.MAX_RELEASE_RUNS + 1])
    if len(runs) > wire.MAX_RELEASE_RUNS:
        raise FieldError(
            "runs",
            f"has {len(request.runs)} runs, at most {wire.MAX_RELEASE_RUNS} per call "
            "(MAX_RELEASE_RUNS)",
        )
    hashes = len(request.packed_hashes) // HASH_BYTES
    if len(runs) > hashes:
        raise FieldError("runs", f"has {len(runs)} runs for {hashes} hashes; a run is not empty")
    if min(runs, default=1) == 0:
        raise FieldError("runs", f"run {runs.index(0)} is empty; every run names a block")
    if max(runs, default=0) > max_blocks:
        raise FieldError(
            "runs", f"a run of {max(runs)} blocks, at most {max_blocks} per run (max_chain_blocks)"
        )
    if sum(runs) != hashes:
        raise FieldError("runs", f"add up to {sum(runs)} hashes, the request has {hashes}")
    return runs


def release_ids(request: pb.ReleaseRequest, runs: int) -> list[int]:
    """A Release's ``release_ids``: none, or one nonzero id per run (one without runs).

    Raises:
        FieldError: another number of ids than runs, or an id of 0.
    """
    sent = len(request.release_ids)
    if not sent:
        return []
    if sent != runs:
        raise FieldError(
            "release_ids", f"has {sent} ids for {runs} runs; send one per run (one without runs)"
        )
    ids = list(request.release_ids)
    if 0 in ids:
        raise FieldError("release_ids", f"id {ids.index(0)} is 0; a release id is nonzero")
    return ids


def unpacked(fn: Callable[[bytes, str], T], packed: bytes, field: str) -> T:
    """``fn(packed, field)`` (a `kvstore.api.wire` unpacker); its errors are FieldErrors."""
    try:
        return fn(packed, field)
    except InvalidArgument as exc:
        raise FieldError(field, str(exc).removeprefix(f"{field} ")) from None


def _hash_tokens(
    root: BlockHash,
    tokens: Tokens,
    block_size: int,
    scheme: HashScheme,
    extras: list[bytes] | None,
) -> list[BlockHash]:
    return hash_blocks(root, token_array(tokens), block_size, scheme=scheme, extras=extras)


async def chain(
    root: BlockHash,
    block_size: int,
    scheme: HashScheme,
    tokens: Tokens,
    hashes: Sequence[bytes],
    extras: Sequence[bytes],
    *,
    max_blocks: int,
    max_tokens: int,
    hashes_checked: bool = False,
) -> tuple[list[BlockHash], int, bool]:
    """The chain a Lookup or Reserve names, from tokens or from hashes.

    Args:
        root: the chain root of the namespace for the calling tenant.
        block_size: tokens per block of the namespace.
        scheme: the namespace's hash scheme.
        tokens, hashes, extras: the request's fields (`request_chain` unpacks
            ``packed_hashes``).
        max_blocks: ``max_chain_blocks`` of the node.
        max_tokens: ``max_request_tokens`` of the node.
        hashes_checked: ``hashes`` came from unpacking a packed field (32
            bytes each, bounded): not checked again. QueryPrefix's repeated
            ``block_hashes`` are checked here.

    Returns:
        (chain, tokens in the query, whether tokens were sent).
    """
    source = validate.chain_source(tokens, hashes, extras, max_tokens, max_blocks, block_size)
    if source == "hashes":
        if hashes_checked:  # unpacked from a packed field: 32 bytes each, bounded
            chain: list[BlockHash] = list(hashes)  # type: ignore[arg-type]
        else:  # a repeated field: every length checked
            chain = await off_loop(len(hashes), validate.block_hashes, hashes, max_blocks)
        return chain, len(chain) * block_size, False
    block_extras: list[bytes] | None = None
    if extras:
        if scheme is HashScheme.VLLM_SHA256_CBOR:
            raise FieldError("extras", "the vllm scheme takes extra keys only through hashes")
        block_extras = list(extras)
    hashed = await off_loop(
        len(tokens) // TOKENS_PER_ITEM, _hash_tokens, root, tokens, block_size, scheme, block_extras
    )
    return hashed, len(tokens), True
