"""Stamp tables: written by the node, read by a runner's mapping, following the arena set."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.hashing import hash_blocks, kvstore_root
from kvstore.pool import CudaMapping, CudaPool, HostMapping, HostPool, PoolUnavailable
from kvstore.pool.arenas import ArenaPool
from kvstore.pool.stamps import STAMP_BYTES, idents_of
from kvstore.stamps import stamp_ident
from kvstore.types import SlotId
from tests.kvstore.pool.conftest import LAYOUT, NS
from tests.kvstore.pool.fake_cuda import FakeCudaRuntime

BLOCK = LAYOUT.block_bytes
UUID0 = "GPU-00000000-0000-0000-0000-000000000000"


def host_arena(pool_dir: Path, serial: int) -> HostPool:
    return HostPool.create(
        NS, BLOCK, 4, 0xABC, directory=str(pool_dir), arena_bytes=4 * BLOCK, first_index=serial
    )


def test_stamps_written_by_the_node_are_read_by_a_runner(pool: HostPool) -> None:
    d = pool.descriptor
    for spec in d.arenas:  # one stamp file per arena, next to it, as private as it
        assert spec.stamp_path == spec.path + "-stamps"
        info = os.stat(spec.stamp_path)
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_size == STAMP_BYTES * d.slots_in_arena(spec.index)
    with HostMapping.open(d) as mapping:
        assert mapping.has_stamps
        assert mapping.read_stamps(np.arange(10)).tolist() == [[0, 0]] * 10  # never stamped
        pool.stamp(SlotId(1), 7, 0)
        pool.stamp(SlotId(9), 8, 0xDEAD)  # the last, smaller arena
        stamps = mapping.read_stamps(np.array([9, 1, 0], dtype=np.uint64))
        assert stamps.dtype == np.uint64 and stamps.tolist() == [[8, 0xDEAD], [7, 0], [0, 0]]
        slots = np.array([1, 9, 5])
        assert mapping.stamps_moved(slots, [7, 8, 0], [0, 0xDEAD, 0]).tolist() == []
        pool.stamp(SlotId(9), 9, 0)  # freed: a new generation, no ident
        assert mapping.stamps_moved(slots, [7, 8, 0], [0, 0xDEAD, 0]).tolist() == [1]
        with pytest.raises(InvalidArgument):
            mapping.read_stamps([10])
    with pytest.raises(PoolUnavailable):
        mapping.read_stamps([0])  # closed


def test_stamp_files_go_with_the_pool(pool_dir: Path) -> None:
    pool = host_arena(pool_dir, 0)
    path = pool.descriptor.arenas[0].stamp_path
    assert os.path.exists(path)
    pool.close()
    assert not os.path.exists(path)
    pool.stamp(SlotId(0), 3, 0)  # a closed pool's stamps went with its files: nothing


def test_stamps_follow_the_arena_set_as_the_pool_grows_and_shrinks(pool_dir: Path) -> None:
    pool = ArenaPool(host_arena(pool_dir, 0), version=1)
    mapping = HostMapping.open(pool.descriptor)
    pool.append(host_arena(pool_dir, 1), version=2)
    pool.stamp(SlotId(6), 11, 22)  # in the new arena
    assert mapping.refresh(pool.descriptor)
    assert mapping.read_stamps([6]).tolist() == [[11, 22]]
    gone = pool.pop(version=3)
    stamp_path = gone.descriptor.arenas[0].stamp_path
    gone.close()
    assert not os.path.exists(stamp_path)
    assert mapping.refresh(pool.descriptor)
    with pytest.raises(InvalidArgument):
        mapping.read_stamps([6])  # given back
    pool.stamp(SlotId(2), 5, 6)
    assert mapping.read_stamps([2]).tolist() == [[5, 6]]
    mapping.close()
    pool.close()
    assert not list(pool_dir.iterdir())


def test_cuda_pool_stamps_live_in_host_shared_memory(pool_dir: Path) -> None:
    rt = FakeCudaRuntime(uuids=[UUID0])
    pool = CudaPool.create(
        NS, BLOCK, 6, 0xE1, device="cuda:0", arena_bytes=4 * BLOCK, runtime=rt,
        stamp_directory=str(pool_dir), prefix="kvs", first_index=7,
    )  # fmt: skip
    paths = [a.stamp_path for a in pool.descriptor.arenas]
    assert [os.path.basename(p) for p in paths] == [
        f"kvs-{os.getpid()}-e1-{NS}-7-stamps",
        f"kvs-{os.getpid()}-e1-{NS}-8-stamps",
    ]
    mapping = CudaMapping.open(pool.descriptor, runtime=rt)
    pool.stamp(SlotId(5), 40, 41)
    calls = len(rt.calls)
    assert mapping.read_stamps([5, 0]).tolist() == [[40, 41], [0, 0]]
    assert len(rt.calls) == calls  # no CUDA call to read a stamp
    mapping.close()
    pool.close()
    assert not any(os.path.exists(p) for p in paths)


def test_cuda_pool_without_a_stamp_directory_has_no_stamps() -> None:
    rt = FakeCudaRuntime(uuids=[UUID0])
    pool = CudaPool.create(NS, BLOCK, 4, 0xE1, device="cuda:0", runtime=rt)
    pool.stamp(SlotId(0), 1, 2)  # nothing to write to
    mapping = CudaMapping.open(pool.descriptor, runtime=rt)
    assert not mapping.has_stamps
    with pytest.raises(PoolUnavailable):
        mapping.read_stamps([0])
    mapping.close()
    pool.close()


def test_idents_of_packed_hashes_match_the_core() -> None:
    hashes = hash_blocks(kvstore_root(b"d" * 32, b"salt"), list(range(16)), 4)
    assert idents_of(b"".join(hashes)).tolist() == [stamp_ident(h) for h in hashes]
