"""A new host arena's pages are allocated and touched when it is made, never in a runner's copy.

The node allocates every page of an arena file (fallocate on tmpfs) and
faults its mapping in when it creates it: tmpfs zeroes a fallocated page
only at its first fault, which would otherwise be the runner's (22 ms per
64 MiB in the runner's ``MAP_POPULATE`` here, against 6 ms for pages the
node touched). A runner's mapping fills its page table entries when it maps
(``MAP_POPULATE``). Where fallocate is not supported the pages are still
touched; a full tmpfs is a clear `LimitExceeded`, with no file left behind.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.errors import LimitExceeded
from kvstore.pool import HostMapping, HostPool, attach
from kvstore.pool import host_pages as pages
from kvstore.pool.host_pages import mapping_address
from kvstore.types import SlotId
from tests.kvstore.pool.conftest import NS

ARENA = 1 << 20
"""A 1 MiB arena: 256 pages of 4 KiB."""


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory on tmpfs, where fallocate allocates memory pages."""
    if not os.path.isdir("/dev/shm") or pages.file_system("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="kvstore-prefault-") as directory:
        yield Path(directory)


def _resident_bytes(mapped: mmap.mmap) -> int:
    """``Rss`` of the mapping of ``mapped`` in /proc/self/smaps (pages with page table entries)."""
    start = mapping_address(mapped)
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= start < high
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found in smaps")


def test_a_new_arena_has_all_its_pages_allocated_and_touched(shm_dir: Path) -> None:
    with HostPool.create(
        NS, 4096, ARENA // 4096, 1, directory=str(shm_dir), huge_pages="off"
    ) as pool:
        (spec,) = pool.descriptor.arenas
        assert os.stat(spec.path).st_blocks * 512 >= ARENA  # tmpfs pages, allocated and zeroed
        # The node faulted every page in (tmpfs zeroes a fallocated page at its first fault).
        assert _resident_bytes(pool._arenas[0].map) == ARENA
        mapping = attach(pool.descriptor)
        try:
            assert isinstance(mapping, HostMapping)
            # The runner's mapping has every page table entry at once (MAP_POPULATE).
            assert _resident_bytes(mapping._arenas[0].map) == ARENA
        finally:
            mapping.close()


def test_without_prefault_nothing_is_allocated(shm_dir: Path) -> None:
    with HostPool.create(NS, 4096, ARENA // 4096, 1, directory=str(shm_dir), prefault=False) as p:
        assert os.stat(p.descriptor.arenas[0].path).st_blocks == 0


def _fallocate_fails(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def fail(fd: int, offset: int, length: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", fail)


def test_where_fallocate_is_unsupported_the_pages_are_still_allocated_and_touched(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fallocate_fails(monkeypatch, errno.EOPNOTSUPP)
    with HostPool.create(
        NS, 4096, ARENA // 4096, 1, directory=str(shm_dir), huge_pages="off"
    ) as pool:
        assert os.stat(pool.descriptor.arenas[0].path).st_blocks * 512 >= ARENA
        assert _resident_bytes(pool._arenas[0].map) == ARENA
        pool.write(SlotId(3), b"\x09" * 4096)
        assert pool.read(SlotId(3)) == b"\x09" * 4096


def test_a_full_tmpfs_is_a_clear_error_and_leaves_no_file(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fallocate_fails(monkeypatch, errno.ENOSPC)
    with pytest.raises(LimitExceeded, match="shared-memory filesystem is full"):
        HostPool.create(NS, 4096, ARENA // 4096, 1, directory=str(shm_dir), huge_pages="off")
    assert os.listdir(shm_dir) == []
