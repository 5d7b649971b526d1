"""Block checksums: the module (`kvstore.checksum`) and the store keeping them."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import xxhash

from kvstore import InvalidArgument, MissReason, Store
from kvstore.checksum import (
    NOT_COMPUTED,
    block_checksum,
    block_checksums,
    matches,
    mismatches,
    pack_checksums,
    unpack_checksums,
)
from tests.kvstore.conftest import ALICE, NS, Runner, chain, prompt


def test_checksum_is_xxh3_64_of_the_bytes_in_any_buffer_form() -> None:
    data = np.arange(4096, dtype=np.float16)
    expected = xxhash.xxh3_64_intdigest(data.tobytes())
    assert block_checksum(data) == expected
    assert block_checksum(memoryview(data).cast("B")) == expected
    assert block_checksum(data.tobytes()) == expected
    assert block_checksum(bytearray(data.tobytes())) == expected


def test_checksum_changes_with_one_flipped_bit() -> None:
    data = bytearray(64 << 10)
    before = block_checksum(data)
    data[12345] ^= 0x10
    assert block_checksum(data) != before


def test_zero_is_reserved_for_not_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstore.checksum as module

    monkeypatch.setattr(module, "_digest", lambda data: 0)
    assert module.block_checksum(b"x") == 1
    assert list(module.block_checksums([b"x", b"y"])) == [1, 1]


def test_many_blocks_at_once() -> None:
    rows = np.random.default_rng(1).integers(0, 255, (8, 1024), dtype=np.uint8)
    sums = block_checksums(rows)  # one row (a view, no copy) per block
    assert isinstance(sums, array) and sums.typecode == "Q"
    assert list(sums) == [block_checksum(r.tobytes()) for r in rows]


def test_pack_is_little_endian_uint64_in_order() -> None:
    values = [1, 2**64 - 1, 0x0102030405060708]
    packed = pack_checksums(values)
    assert packed == b"".join(v.to_bytes(8, "little") for v in values)
    assert list(unpack_checksums(packed, 3)) == values
    assert list(unpack_checksums(b"", 2)) == [NOT_COMPUTED, NOT_COMPUTED]


def test_unpack_of_a_wrong_length_says_what_is_wrong() -> None:
    with pytest.raises(InvalidArgument, match="16 bytes: 3 blocks need 24"):
        unpack_checksums(bytes(16), 3)
    with pytest.raises(InvalidArgument, match="7 bytes"):
        unpack_checksums(bytes(7), 1)


def test_mismatches_lists_wrong_blocks_and_skips_unknown_ones() -> None:
    blocks = [bytes([i]) * 256 for i in range(4)]
    sums = list(block_checksums(blocks))
    assert mismatches(blocks, sums) == []
    bad = [blocks[0], blocks[2], blocks[2], blocks[3]]  # block 1 holds block 2's bytes
    assert mismatches(bad, sums) == [1]
    assert mismatches(bad, [sums[0], NOT_COMPUTED, sums[2], sums[3]]) == []
    assert matches(blocks[1], NOT_COMPUTED) and not matches(blocks[1], sums[0])


def test_commit_keeps_the_writers_checksums_and_lookup_returns_them(store: Store) -> None:
    runner = Runner(store, 1)
    hashes = chain(prompt(1, 1))
    store.reserve(NS, ALICE, runner.lease, hashes, 1.0)
    sums = [11, 22, 0, 44, 55]  # 0: the writer sent none for block 2
    assert store.commit(NS, ALICE, runner.lease, hashes, 1.0, sums) == 5
    result = store.lookup(NS, ALICE, hashes, 2.0)
    assert result.miss_reason is MissReason.NONE
    assert list(result.checksums) == sums
    assert [b.checksum for b in result.blocks] == sums
    # A retried commit with other checksums does not rewrite a READY block's.
    assert store.commit(NS, ALICE, runner.lease, hashes, 3.0, [9] * 5) == 0
    assert list(store.lookup(NS, ALICE, hashes, 4.0).checksums) == sums


def test_commit_without_checksums_stores_not_computed(store: Store) -> None:
    runner = Runner(store, 1)
    hashes = chain(prompt(2, 1))
    store.reserve(NS, ALICE, runner.lease, hashes, 1.0)
    store.commit(NS, ALICE, runner.lease, hashes, 1.0)
    assert list(store.lookup(NS, ALICE, hashes, 2.0).checksums) == [NOT_COMPUTED] * 5


def test_commit_with_a_checksum_count_that_does_not_match_commits_nothing(store: Store) -> None:
    runner = Runner(store, 1)
    hashes = chain(prompt(3, 1))
    store.reserve(NS, ALICE, runner.lease, hashes, 1.0)
    with pytest.raises(InvalidArgument, match="4 checksums for 5 blocks"):
        store.commit(NS, ALICE, runner.lease, hashes, 1.0, [1, 2, 3, 4])
    assert store.lookup(NS, ALICE, hashes, 2.0).hit_blocks == 0
