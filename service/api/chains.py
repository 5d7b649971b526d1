"""The chain of block hashes a Lookup or Reserve names, computed off the event loop.

A request sends either the hashes or the tokens (the node then hashes them
with the namespace's scheme under the tenant's root). Both are bounded
before any work: at most ``max_chain_blocks`` hashes, at most
``max_request_tokens`` tokens (and no more than ``max_chain_blocks`` blocks
of them). Turning tokens into an array and hashing them runs on a worker
thread (`service.api.offload`), in chunks, so the loop keeps serving.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.hashing import HashScheme, hash_blocks
from kvstore.types import BlockHash
from service.api import validate
from service.api.errors import FieldError
from service.api.offload import off_loop

TOKEN_CHUNK = 65536
"""Tokens copied out of the request per C call: each holds the GIL, the loop waits."""


def token_array(tokens: Sequence[int]) -> np.ndarray:
    """``tokens`` (a protobuf repeated field) as a uint32 array, in GIL-friendly chunks."""
    n = len(tokens)
    out = np.empty(n, dtype=np.uint32)
    for start in range(0, n, TOKEN_CHUNK):
        chunk = tokens[start : start + TOKEN_CHUNK]
        out[start : start + len(chunk)] = chunk
    return out


def _hash_tokens(
    root: BlockHash,
    tokens: Sequence[int],
    block_size: int,
    scheme: HashScheme,
    extras: list[bytes] | None,
) -> list[BlockHash]:
    return hash_blocks(root, token_array(tokens), block_size, scheme=scheme, extras=extras)


async def chain(
    root: BlockHash,
    block_size: int,
    scheme: HashScheme,
    tokens: Sequence[int],
    hashes: Sequence[bytes],
    extras: Sequence[bytes],
    *,
    max_blocks: int,
    max_tokens: int,
) -> tuple[list[BlockHash], int, bool]:
    """The chain a Lookup or Reserve names, from tokens or from hashes.

    Args:
        root: the chain root of the namespace for the calling tenant.
        block_size: tokens per block of the namespace.
        scheme: the namespace's hash scheme.
        tokens, hashes, extras: the request's fields.
        max_blocks: ``max_chain_blocks`` of the node.
        max_tokens: ``max_request_tokens`` of the node.

    Returns:
        (chain, tokens in the query, whether tokens were sent).
    """
    source = validate.chain_source(tokens, hashes, extras, max_tokens, max_blocks, block_size)
    if source == "hashes":
        chain = await off_loop(len(hashes), validate.block_hashes, hashes, max_blocks)
        return chain, len(chain) * block_size, False
    block_extras: list[bytes] | None = None
    if extras:
        if scheme is HashScheme.VLLM_SHA256_CBOR:
            raise FieldError("extras", "the vllm scheme takes extra keys only through hashes")
        block_extras = list(extras)
    hashed = await off_loop(
        len(tokens), _hash_tokens, root, tokens, block_size, scheme, block_extras
    )
    return hashed, len(tokens), True
