"""HostPool: file creation, modes, slot addressing, reads, writes and closing."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument
from kvstore.pool import ArenaSpec, HostMapping, HostPool, PoolDescriptor, PoolUnavailable
from kvstore.pool.arenas import ArenaPool
from kvstore.types import SlotId

from .conftest import NS


def test_descriptor_shape(pool: HostPool, pool_dir: Path) -> None:
    d = pool.descriptor
    assert (d.kind, d.epoch, d.namespace, d.device) == ("host", 0xABC, NS, "cpu")
    assert (d.block_bytes, d.capacity, d.slots_per_arena) == (256, 10, 4)
    assert [a.size_bytes for a in d.arenas] == [1024, 1024, 512]
    assert [a.index for a in d.arenas] == [0, 1, 2]
    pid = os.getpid()
    assert [Path(a.path).name for a in d.arenas] == [
        f"kvstore-{pid}-abc-{NS}-{i}" for i in range(3)
    ]
    for arena in d.arenas:
        assert os.path.getsize(arena.path) == arena.size_bytes


@pytest.mark.parametrize(
    ("slot", "where"),
    [(0, (0, 0)), (3, (0, 768)), (4, (1, 0)), (7, (1, 768)), (8, (2, 0)), (9, (2, 256))],
)
def test_locate_at_arena_boundaries(pool: HostPool, slot: int, where: tuple[int, int]) -> None:
    assert pool.locate(SlotId(slot)) == where
    assert pool.descriptor.locate(slot) == where


@pytest.mark.parametrize("slot", [-1, 10, 1 << 40])
def test_locate_out_of_range(pool: HostPool, slot: int) -> None:
    with pytest.raises(InvalidArgument, match="out of range"):
        pool.locate(SlotId(slot))
    with pytest.raises(InvalidArgument):
        pool.view(SlotId(slot))
    with pytest.raises(InvalidArgument):
        pool.write(SlotId(slot), bytes(256))


def test_one_slot_per_arena_when_blocks_exceed_arena_bytes(pool_dir: Path) -> None:
    with HostPool.create(NS, 300, 3, 1, directory=str(pool_dir), arena_bytes=100) as p:
        assert p.descriptor.slots_per_arena == 1
        assert len(p.descriptor.arenas) == 3
        assert p.locate(SlotId(2)) == (2, 0)


def test_write_read_roundtrip_and_isolation(pool: HostPool) -> None:
    for slot in range(10):
        pool.write(SlotId(slot), bytes([slot]) * 256)
    for slot in range(10):
        assert pool.read(SlotId(slot)) == bytes([slot]) * 256
    view = pool.view(SlotId(5))
    assert len(view) == 256 and not view.readonly
    view[:3] = b"abc"
    assert pool.read(SlotId(5))[:4] == b"abc\x05"
    assert pool.read(SlotId(4)) == b"\x04" * 256


def test_read_into_copies_a_slot_into_a_buffer(pool: HostPool) -> None:
    pool.write(SlotId(3), bytes(range(256)))
    out = bytearray(256)
    pool.read_into(SlotId(3), memoryview(out))
    assert out == bytes(range(256))
    with pytest.raises(InvalidArgument, match="256 bytes"):
        pool.read_into(SlotId(3), memoryview(bytearray(255)))


@pytest.mark.parametrize("size", [0, 255, 257])
def test_wrong_size_write(pool: HostPool, size: int) -> None:
    with pytest.raises(InvalidArgument, match="256 bytes"):
        pool.write(SlotId(0), bytes(size))


def test_file_mode_is_0600_by_default(pool: HostPool) -> None:
    for arena in pool.descriptor.arenas:
        assert stat.S_IMODE(os.stat(arena.path).st_mode) == 0o600


def test_group_mode_is_exact_despite_umask(pool_dir: Path) -> None:
    old = os.umask(0o077)
    try:
        p = HostPool.create(NS, 64, 2, 2, directory=str(pool_dir), mode=0o660)
    finally:
        os.umask(old)
    with p:
        assert stat.S_IMODE(os.stat(p.descriptor.arenas[0].path).st_mode) == 0o660


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o601, 0o666])
def test_world_accessible_mode_refused(pool_dir: Path, mode: int) -> None:
    with pytest.raises(InvalidArgument, match="world"):
        HostPool.create(NS, 64, 2, 3, directory=str(pool_dir), mode=mode)
    assert list(pool_dir.iterdir()) == []


def test_existing_file_is_not_reused(pool: HostPool, pool_dir: Path) -> None:
    with pytest.raises(FileExistsError):
        HostPool.create(NS, 256, 10, 0xABC, directory=str(pool_dir), arena_bytes=1124)
    # The failed create removed nothing of the live pool.
    assert all(os.path.exists(a.path) for a in pool.descriptor.arenas)


def test_failed_create_leaves_no_files(pool_dir: Path) -> None:
    # The second arena's name is taken: the first arena must be unlinked again.
    (pool_dir / f"kvstore-{os.getpid()}-7-{NS}-1").write_bytes(b"")
    with pytest.raises(FileExistsError):
        HostPool.create(NS, 64, 4, 7, directory=str(pool_dir), arena_bytes=128)
    assert [p.name for p in pool_dir.iterdir()] == [f"kvstore-{os.getpid()}-7-{NS}-1"]


def test_close_unlinks_and_is_idempotent(pool: HostPool) -> None:
    paths = [a.path for a in pool.descriptor.arenas]
    pool.close()
    assert pool.closed
    assert not any(os.path.exists(p) for p in paths)
    pool.close()
    with pytest.raises(PoolUnavailable, match="closed"):
        pool.view(SlotId(0))


def test_close_with_live_view_keeps_memory_valid(pool: HostPool) -> None:
    view = pool.view(SlotId(1))
    pool.close()
    view[:2] = b"ok"  # still mapped through the view: no crash, no dangling pointer
    assert bytes(view[:2]) == b"ok"
    assert not os.path.exists(pool.descriptor.arenas[0].path)


def test_default_directory_is_tmpfs() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with HostPool.create(NS, 64, 2, 0xD0D0, prefix="kvstore-test") as p:
        path = p.descriptor.arenas[0].path
        assert path.startswith("/dev/shm/kvstore-test-")
        assert os.path.exists(path)
    assert not os.path.exists(path)


def test_no_prefault(pool_dir: Path) -> None:
    with HostPool.create(NS, 64, 4, 4, directory=str(pool_dir), prefault=False) as p:
        p.write(SlotId(3), b"z" * 64)
        assert p.read(SlotId(3)) == b"z" * 64


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": 0},
        {"arenas": ()},
        {"slots_per_arena": 0},
        {"kind": "disk"},
        {"arenas": (ArenaSpec(1, 256, "x"),)},
        {"arenas": (ArenaSpec(0, 255, "x"),)},
    ],
)
def test_descriptor_validation(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {
        "kind": "host",
        "epoch": 1,
        "namespace": NS,
        "block_bytes": 256,
        "capacity": 1,
        "slots_per_arena": 1,
        "arenas": (ArenaSpec(0, 256, "x"),),
    }
    fields.update(kwargs)
    with pytest.raises(InvalidArgument):
        PoolDescriptor(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs", [{"block_bytes": 0}, {"capacity": -1}, {"arena_bytes": 0}, {"prefix": "a/b"}]
)
def test_create_validation(pool_dir: Path, kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"block_bytes": 64, "capacity": 2, "directory": str(pool_dir)}
    args.update(kwargs)
    with pytest.raises(InvalidArgument):
        HostPool.create(NS, epoch=1, **args)  # type: ignore[arg-type]


# --- pools that grow and give back arenas (kvstore.pool.arenas, HostMapping.refresh) ----------


def _arena(pool_dir: Path, serial: int) -> HostPool:
    return HostPool.create(
        NS, 256, 4, 0xABC, directory=str(pool_dir), arena_bytes=4 * 256, first_index=serial
    )


def test_an_arena_pool_grows_and_gives_back_its_last_arena(pool_dir: Path) -> None:
    pool = ArenaPool(_arena(pool_dir, 1), version=1)
    try:
        pool.write(SlotId(3), b"\x01" * 256)
        pool.append(_arena(pool_dir, 2), version=2)
        d = pool.descriptor
        assert (d.capacity, d.slots_per_arena, d.version, d.total_bytes) == (8, 4, 2, 2048)
        assert [a.index for a in d.arenas] == [0, 1]
        assert [Path(a.path).name.rsplit("-", 1)[1] for a in d.arenas] == ["1", "2"]
        pool.write(SlotId(5), b"\x02" * 256)
        assert pool.read(SlotId(3)) == b"\x01" * 256 and pool.read(SlotId(5)) == b"\x02" * 256
        last = pool.pop(version=3)
        assert pool.descriptor.capacity == 4 and pool.descriptor.version == 3
        last.close()
        assert not os.path.exists(d.arenas[1].path)
        with pytest.raises(InvalidArgument):
            pool.read(SlotId(5))
        with pytest.raises(RuntimeError):
            pool.pop(version=4)  # a pool keeps its first arena
        odd = HostPool.create(NS, 256, 2, 0xABC, directory=str(pool_dir), first_index=9)
        with pytest.raises(InvalidArgument, match="geometry"):
            pool.append(odd, version=5)
        odd.close()
    finally:
        pool.close()
    assert not os.listdir(pool_dir)  # every arena file unlinked


def test_a_mapping_follows_added_and_given_back_arenas_in_place(pool_dir: Path) -> None:
    pool = ArenaPool(_arena(pool_dir, 1), version=1)
    mapping = HostMapping.open(pool.descriptor)
    try:
        pool.write(SlotId(1), b"\x07" * 256)
        early = mapping.buffer(SlotId(1))
        pool.append(_arena(pool_dir, 2), version=2)
        with pytest.raises(InvalidArgument):
            mapping.buffer(SlotId(6))  # not mapped yet
        assert mapping.refresh(pool.descriptor)
        mapping.buffer(SlotId(6))[:] = b"\x08" * 256
        assert pool.read(SlotId(6)) == b"\x08" * 256
        assert bytes(early) == b"\x07" * 256  # a view from before stays valid
        pool.pop(version=3).close()
        assert mapping.refresh(pool.descriptor) and mapping.descriptor.capacity == 4
        # The last arena replaced by another (given back, then grown again): attach anew.
        pool.append(_arena(pool_dir, 3), version=4)
        replaced = dataclasses.replace(
            pool.descriptor,
            arenas=(pool.descriptor.arenas[0], ArenaSpec(1, 1024, "/nonexistent/elsewhere")),
        )
        assert mapping.refresh(pool.descriptor)
        assert not mapping.refresh(replaced)  # another file where arena 1 was
        assert mapping.descriptor == pool.descriptor  # unchanged
        other = dataclasses.replace(pool.descriptor, namespace="ffffffffffffffff")
        with pytest.raises(InvalidArgument):
            mapping.refresh(other)
    finally:
        del early
        mapping.close()
        pool.close()
