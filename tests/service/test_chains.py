"""The chain a request names: chunked token copies and the off-loop hashing give
the same hashes as the one implementation in `kvstore.hashing`."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.hashing import HashScheme, hash_blocks
from kvstore.v1 import kvstore_pb2 as pb
from service.api import chains

ROOT = bytes(range(32))


def test_token_array_copies_every_chunk_in_order() -> None:
    n = 2 * chains.TOKEN_CHUNK + 5
    values = [(i * 7919) % (2**32) for i in range(n)]
    request = pb.LookupRequest(tokens=values)
    assert np.array_equal(chains.token_array(request.tokens), np.array(values, dtype=np.uint32))


@pytest.mark.parametrize("scheme", list(HashScheme))
async def test_a_long_chain_hashed_off_the_loop_matches_hash_blocks(scheme) -> None:
    tokens = list(range(100_000, 100_000 + 16 * 1000 + 3))  # over the inline bound, a tail
    request = pb.LookupRequest(tokens=tokens)
    chain, query_tokens, from_tokens = await chains.chain(
        ROOT, 16, scheme, request.tokens, [], [], max_blocks=1000, max_tokens=len(tokens)
    )
    assert chain == hash_blocks(ROOT, tokens, 16, scheme=scheme)
    assert (len(chain), query_tokens, from_tokens) == (1000, len(tokens), True)


async def test_limits_are_named() -> None:
    with pytest.raises(InvalidArgument, match="max_request_tokens"):
        await chains.chain(
            ROOT, 16, HashScheme.KVSTORE_SHA256, [1] * 33, [], [], max_blocks=8, max_tokens=32
        )
    # 35 tokens are 8 full blocks and a partial one (not hashed): within 8 blocks.
    await chains.chain(
        ROOT, 4, HashScheme.KVSTORE_SHA256, [1] * 35, [], [], max_blocks=8, max_tokens=64
    )
    with pytest.raises(InvalidArgument, match=r"9 full blocks.*max_chain_blocks"):
        await chains.chain(
            ROOT, 4, HashScheme.KVSTORE_SHA256, [1] * 36, [], [], max_blocks=8, max_tokens=64
        )
    with pytest.raises(InvalidArgument, match="max_chain_blocks"):
        await chains.chain(
            ROOT, 4, HashScheme.KVSTORE_SHA256, [], [ROOT] * 9, [], max_blocks=8, max_tokens=64
        )
