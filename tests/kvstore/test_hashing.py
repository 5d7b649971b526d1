"""Chained prefix hashes: chaining, isolation, encodings and the vLLM vector."""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import numpy as np
import pytest

from kvstore import InvalidArgument
from kvstore.hashing import (
    HashScheme,
    cbor_encode,
    hash_blocks,
    kvstore_root,
    token_bytes,
    vllm_root,
)
from kvstore.types import BlockHash

ROOT = kvstore_root(b"\x01" * 32, b"salt")


def test_only_full_blocks_are_hashed() -> None:
    assert len(hash_blocks(ROOT, list(range(15)), 4)) == 3
    assert hash_blocks(ROOT, list(range(3)), 4) == []


def test_each_hash_covers_every_earlier_token() -> None:
    a = list(range(16))
    b = [99, *a[1:]]  # differs only in the very first token
    ha, hb = hash_blocks(ROOT, a, 4), hash_blocks(ROOT, b, 4)
    assert all(x != y for x, y in zip(ha, hb, strict=True))


def test_shared_prefix_gives_shared_hashes() -> None:
    a = [*list(range(12)), 1, 2, 3, 4]
    b = [*list(range(12)), 5, 6, 7, 8]
    ha, hb = hash_blocks(ROOT, a, 4), hash_blocks(ROOT, b, 4)
    assert ha[:3] == hb[:3]
    assert ha[3] != hb[3]


def test_root_separates_namespaces_and_salts() -> None:
    tokens = list(range(8))
    base = hash_blocks(kvstore_root(b"\x01" * 32, b"a"), tokens, 4)
    assert hash_blocks(kvstore_root(b"\x01" * 32, b"b"), tokens, 4)[0] != base[0]
    assert hash_blocks(kvstore_root(b"\x02" * 32, b"a"), tokens, 4)[0] != base[0]


def test_root_encoding_is_unambiguous() -> None:
    # Length prefixes keep (ns, salt) boundaries from shifting.
    assert kvstore_root(b"ab", b"c") != kvstore_root(b"a", b"bc")


def test_extra_changes_only_its_block_and_later() -> None:
    tokens = list(range(12))
    plain = hash_blocks(ROOT, tokens, 4)
    lora = hash_blocks(ROOT, tokens, 4, extras=[None, b"lora:x", None])
    assert plain[0] == lora[0]
    assert plain[1] != lora[1] and plain[2] != lora[2]


def test_default_encoding_is_documented_byte_layout() -> None:
    tokens = [1, 2, 3, 70000]
    expected = hashlib.sha256(
        ROOT + (0).to_bytes(4, "little") + b"".join(t.to_bytes(4, "little") for t in tokens)
    ).digest()
    assert hash_blocks(ROOT, tokens, 4) == [expected]


def test_numpy_and_list_inputs_agree() -> None:
    tokens = list(range(64))
    assert hash_blocks(ROOT, np.array(tokens, dtype=np.int64), 16) == hash_blocks(ROOT, tokens, 16)
    assert hash_blocks(ROOT, np.array(tokens, dtype=np.uint32), 16) == hash_blocks(ROOT, tokens, 16)


@pytest.mark.parametrize("bad", [[-1, 2, 3, 4], [2**32, 1, 2, 3]])
def test_out_of_range_tokens_are_rejected(bad: list[int]) -> None:
    with pytest.raises(InvalidArgument, match="token ids"):
        token_bytes(bad)


def test_bad_arguments_are_typed_errors() -> None:
    with pytest.raises(InvalidArgument):
        hash_blocks(ROOT, [1, 2], 0)
    with pytest.raises(InvalidArgument):
        hash_blocks(BlockHash(b"short"), [1, 2], 1)
    with pytest.raises(InvalidArgument):
        hash_blocks(ROOT, [[1, 2]], 1)  # type: ignore[list-item]
    with pytest.raises(InvalidArgument):
        hash_blocks(ROOT, [1.5, 2.5], 1)  # type: ignore[list-item]
    with pytest.raises(InvalidArgument):
        hash_blocks(ROOT, [1, 2, 3, 4], 2, extras=[b"x"])


def test_cbor_encoder_matches_cbor2_canonical() -> None:
    values: list[object] = [
        None, True, False, 0, 23, 24, 255, 256, 65535, 65536, 2**32, 2**64 - 1,
        -1, -24, -25, -(2**32), b"", b"ab", b"x" * 300, "", "héllo", "k" * 70000,
        (), (1, (2, 3), None, b"x"), tuple(range(1000)), ["a", ("b", 7)],
    ]  # fmt: skip
    for value in values:
        assert cbor_encode(value) == cbor2.dumps(value, canonical=True), value


def test_vllm_scheme_matches_reference_construction() -> None:
    # vLLM: NONE_HASH = sha256_cbor(PYTHONHASHSEED); block hash =
    # sha256(cbor2.dumps((parent, tuple(tokens), extra_keys), canonical=True)).
    seed = "0"
    root = vllm_root(seed)
    assert root == hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    tokens = list(range(32))
    extras = [None, ("lora-a",)]
    ours = hash_blocks(root, tokens, 16, scheme=HashScheme.VLLM_SHA256_CBOR, extras=extras)
    parent = root
    for i, extra in enumerate(extras):
        ref = cbor2.dumps((parent, tuple(tokens[16 * i : 16 * (i + 1)]), extra), canonical=True)
        parent = hashlib.sha256(ref).digest()
        assert ours[i] == parent


def test_vllm_scheme_pinned_vector() -> None:
    # Pinned so an accidental change of the encoding cannot pass silently:
    # PYTHONHASHSEED=0, block_size=16, tokens 0..31, no extra keys.
    hashes = hash_blocks(vllm_root("0"), list(range(32)), 16, scheme=HashScheme.VLLM_SHA256_CBOR)
    assert vllm_root("0").hex() == VLLM_ROOT_SEED0
    assert [h.hex() for h in hashes] == VLLM_BLOCKS_SEED0


def test_naive_pickle_baseline_differs_but_is_deterministic() -> None:
    # The benchmark's naive baseline must hash the same amount of input.
    block = tuple(range(16))
    a = hashlib.sha256(pickle.dumps((ROOT, block, None))).digest()
    b = hashlib.sha256(pickle.dumps((ROOT, block, None))).digest()
    assert a == b


VLLM_ROOT_SEED0 = "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
VLLM_BLOCKS_SEED0 = [
    "d830de3d42c00f25a2949b5d12d98642664a44872c1614c5b0147556276afc9c",
    "fedd9e4abebebbe6f6cf96b682f08d316063fe2f22a5c552192dd62904fcccac",
]
