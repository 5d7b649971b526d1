"""The chain a request names: chunked token copies and the off-loop hashing give
the same hashes as the one implementation in `kvstore.hashing`."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.hashing import HashScheme, hash_blocks
from kvstore.layout import KVLayout, NamespaceSpec
from kvstore.types import TenantId
from kvstore.v1 import kvstore_pb2 as pb
from service.api import chains
from service.tenancy.callers import ChainRoots

ROOT = bytes(range(32))


def test_token_array_copies_every_token_in_order() -> None:
    n = 2 * 65536 + 5
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


async def test_a_chain_of_8192_tokens_is_hashed_on_the_loop_thread(monkeypatch) -> None:
    """Up to 8192 tokens hash inline: a worker thread only adds a GIL handoff."""
    threads: list[int] = []
    hash_tokens = chains._hash_tokens

    def spy(*args):
        threads.append(threading.get_ident())
        return hash_tokens(*args)

    monkeypatch.setattr(chains, "_hash_tokens", spy)
    for n in (8192, 8192 + 16):
        tokens = np.arange(n, dtype=np.uint32)
        await chains.chain(
            ROOT, 16, HashScheme.KVSTORE_SHA256, tokens, [], [], max_blocks=1000, max_tokens=n
        )
    assert threads[0] == threading.get_ident()  # inline
    assert threads[1] != threading.get_ident()  # 513 blocks' worth: a worker thread


def test_chain_roots_are_cached_without_the_spec_digest(monkeypatch) -> None:
    """A cached root costs a dict lookup, not the spec's JSON digest (~50 µs a Lookup)."""
    roots = ChainRoots(b"secret")
    spec = NamespaceSpec("m", KVLayout(2, 2, 4, 4, "float16"))
    first = roots.root(spec, TenantId("t"), shared=False)
    digests = []
    digest = NamespaceSpec.digest
    monkeypatch.setattr(NamespaceSpec, "digest", lambda s: digests.append(s) or digest(s))
    assert roots.root(spec, TenantId("t"), shared=False) == first
    assert digests == []
    assert roots.root(spec, TenantId("u"), shared=False) != first  # another tenant's salt
    assert len(digests) == 1
