"""Chained prefix hashes: chaining, isolation, encodings and the vLLM vector."""

from __future__ import annotations

import hashlib
import pickle
import sys

import cbor2
import numpy as np
import pytest

from kvstore import InvalidArgument
from kvstore.cbor import encode_uints
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


BOUNDARIES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1]


def _cbor2_chain(
    root: bytes, tokens: list[int], block_size: int, extras: list[object]
) -> list[bytes]:
    parent, out = root, []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(cbor2.dumps((parent, block, extras[i]), canonical=True)).digest()
        out.append(parent)
    return out


def test_uint_encoder_matches_cbor2_at_every_width() -> None:
    values = np.array([*BOUNDARIES, 22, 100, 1000, 70000, 2**31], dtype=np.int64)
    data, ends = encode_uints(values)
    starts = [0, *ends[:-1].tolist()]
    for value, start, end in zip(values.tolist(), starts, ends.tolist(), strict=True):
        assert data[start:end] == cbor2.dumps(value, canonical=True), value
    assert encode_uints(np.array([], dtype=np.int64))[0] == b""


@pytest.mark.parametrize("block_size", [1, 16, 24, 300])
@pytest.mark.parametrize("dtype", [np.int64, np.uint32, None])
def test_fast_vllm_encoder_gives_cbor2_bytes_for_random_tokens(
    block_size: int, dtype: object
) -> None:
    rng = np.random.default_rng(block_size)
    for trial in range(4):
        n = int(rng.integers(0, 5 * block_size + 3))
        widths = rng.integers(0, 5, size=n)
        tokens = [
            int(rng.integers(0, (24, 256, 65536, 2**32, 2**32)[w]))
            if w < 4
            else BOUNDARIES[int(rng.integers(0, 9))]
            for w in widths
        ]
        n_blocks = n // block_size
        lora = ("lora-a", 7, b"mm")
        extras: list[object] = [None if rng.integers(0, 2) else lora for _ in range(n_blocks)]
        root = vllm_root(str(trial))
        given = tokens if dtype is None else np.array(tokens, dtype=dtype)
        scheme = HashScheme.VLLM_SHA256_CBOR
        assert hash_blocks(root, given, block_size, scheme=scheme) == _cbor2_chain(
            root, tokens, block_size, [None] * n_blocks
        )
        assert hash_blocks(root, given, block_size, scheme=scheme, extras=extras) == _cbor2_chain(
            root, tokens, block_size, extras
        )
        empty: list[object] = [()] * n_blocks  # an empty tuple is not None: 0x80, not 0xf6
        assert hash_blocks(root, given, block_size, scheme=scheme, extras=empty) == _cbor2_chain(
            root, tokens, block_size, empty
        )


def test_vllm_scheme_tokens_beyond_u32_still_match_cbor2() -> None:
    # Not token ids a model makes, but the encoding stays cbor2's (the general path).
    root = vllm_root("0")
    tokens = [-1, 2**32, 2**40, 5, -(2**33), 0, 24, 23]
    ours = hash_blocks(root, tokens, 4, scheme=HashScheme.VLLM_SHA256_CBOR)
    assert ours == _cbor2_chain(root, tokens, 4, [None, None])


def test_vllm_scheme_rejects_non_tuple_extras() -> None:
    with pytest.raises(InvalidArgument):
        hash_blocks(
            vllm_root("0"),
            list(range(32)),
            16,
            scheme=HashScheme.VLLM_SHA256_CBOR,
            extras=[None, [1]],
        )


def test_hashing_bench_compares_with_cbor2_and_runs_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvstore.cli.microbench import Sizes, hashing

    tiny = Sizes(tokens=256, resident=0, metadata_blocks=0)
    assert hashing(tiny)["vllm_cbor2_hashlib_tokens_per_s"] > 0
    monkeypatch.setitem(sys.modules, "cbor2", None)  # import cbor2 now raises ImportError
    row = hashing(tiny)
    assert "vllm_cbor2_hashlib_tokens_per_s" not in row
    assert row["vllm_sha256_cbor_tokens_per_s"] > 0
