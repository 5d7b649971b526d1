"""Huge pages for host pools: when they are offered, that they are asked for, what is reported."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import InvalidArgument, LimitExceeded
from kvstore.pool import HostMapping, HostPool, attach
from kvstore.pool import host_pages as pages
from kvstore.pool.host_pages import HugePageSupport
from kvstore.types import SlotId
from tests.kvstore.pool.conftest import NS

MOUNTS = """\
proc /proc proc rw 0 0
tmpfs /dev/shm tmpfs rw,nosuid,size=65536k 0 0
tmpfs /mnt/huge tmpfs rw,relatime,size=1048576k,huge=within_size 0 0
tmpfs /mnt/adv tmpfs rw,huge=advise 0 0
/dev/sda1 /data ext4 rw 0 0
"""


@pytest.mark.parametrize(
    ("policy", "directory", "possible", "said"),
    [
        ("always within_size advise [never] deny force", "/dev/shm", False, "huge=never"),
        ("always within_size advise [never] deny force", "/dev/shm/sub", False, "huge=never"),
        ("always within_size advise [never] deny force", "/mnt/huge/x", True, "within_size"),
        ("always within_size [advise] never deny force", "/mnt/adv", True, "huge=advise"),
        ("always within_size advise never [deny] force", "/mnt/huge", False, "deny"),
        ("always within_size advise never deny [force]", "/dev/shm", True, "force"),
        ("always within_size advise never deny [force]", "/data", False, "ext4"),
        ("[always] within_size advise never deny force", "/dev/shm", False, "memfd"),
    ],
)
def test_support_follows_the_shmem_policy_and_the_mount(
    tmp_path: Path, policy: str, directory: str, possible: bool, said: str
) -> None:
    (tmp_path / "shmem_enabled").write_text(policy + "\n")
    (tmp_path / "mounts").write_text(MOUNTS)
    offer = pages.support(
        directory, shmem_enabled=str(tmp_path / "shmem_enabled"), mounts=str(tmp_path / "mounts")
    )
    assert offer.possible is possible
    assert said in offer.reason


def test_no_shmem_policy_file_means_no_huge_pages(tmp_path: Path) -> None:
    offer = pages.support("/dev/shm", shmem_enabled=str(tmp_path / "absent"))
    assert not offer.possible


def test_huge_bytes_are_read_from_the_mappings_smaps_entries(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0000400000 rw-s 00000000 00:1a 12 /dev/shm/a\n"
        "Size:               4096 kB\nShmemPmdMapped:     2048 kB\nFilePmdMapped:         0 kB\n"
        "7f0000400000-7f0000800000 rw-s 00000000 00:1a 13 /dev/shm/b\n"
        "Size:               4096 kB\nShmemPmdMapped:     4096 kB\n"
        "VmFlags: rd wr sh mr mw me ms hg\n"
    )
    at = 0x7F0000000000
    assert pages.huge_bytes_in_range(at, at + (4 << 20), smaps=str(smaps)) == 2 << 20
    assert pages.huge_bytes_in_range(at, at + (8 << 20), smaps=str(smaps)) == 6 << 20
    assert pages.huge_bytes_in_range(at + (8 << 20), at + (9 << 20), smaps=str(smaps)) is None
    assert pages.huge_bytes_in_range(at, at + 1, smaps=str(tmp_path / "absent")) is None


def test_a_real_mapping_is_found_in_smaps(pool: HostPool) -> None:
    arena = pool._arenas[0]
    assert pages.mapped_huge_bytes(arena.map) is not None
    arena.close()
    assert arena.map.closed  # the address lookup left no export behind
    pool._arenas = pool._arenas[1:]


def _offer(monkeypatch: pytest.MonkeyPatch, possible: bool) -> list[str]:
    """Pretend the kernel does (not) offer huge pages; record what the pool does, in order."""
    calls: list[str] = []
    monkeypatch.setattr(pages, "support", lambda directory: HugePageSupport(possible, "simulated"))
    monkeypatch.setattr(pages, "advise", lambda mapped: calls.append("advise") or True)
    real_populate, real_reserve = pages.populate, pages.reserve

    def populate(mapped: mmap.mmap, *, write: bool) -> None:
        calls.append("populate-write" if write else "populate-read")
        real_populate(mapped, write=write)

    def reserve(fd: int, path: str, size: int) -> None:
        calls.append("reserve")
        real_reserve(fd, path, size)

    monkeypatch.setattr(pages, "populate", populate)
    monkeypatch.setattr(pages, "reserve", reserve)
    monkeypatch.setattr(pages, "populate_read", lambda mapped: calls.append("populate-read"))
    return calls


def test_where_huge_pages_are_not_offered_the_pool_falls_back_to_small_pages(
    pool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _offer(monkeypatch, possible=False)
    with HostPool.create(NS, 256, 4, 1, directory=str(pool_dir), huge_pages="auto") as pool:
        assert calls == ["reserve", "populate-write"]  # no madvise, as before
        assert pool.huge_page_bytes == 0
        pool.write(SlotId(3), b"\x07" * 256)
        mapping = attach(pool.descriptor)
        try:
            assert isinstance(mapping, HostMapping) and mapping.huge_page_bytes == 0
            assert bytes(mapping.buffer(SlotId(3))) == b"\x07" * 256
        finally:
            mapping.close()
        assert "advise" not in calls


def test_huge_pages_on_where_not_offered_is_refused(
    pool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _offer(monkeypatch, possible=False)
    with pytest.raises(InvalidArgument, match=r"no huge pages.*simulated"):
        HostPool.create(NS, 256, 4, 1, directory=str(pool_dir), huge_pages="on")
    assert os.listdir(pool_dir) == []
    with pytest.raises(InvalidArgument, match="auto, on or off"):
        HostPool.create(NS, 256, 4, 1, directory=str(pool_dir), huge_pages="yes")  # type: ignore[arg-type]


def test_where_offered_both_sides_madvise_before_faulting_in(
    pool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _offer(monkeypatch, possible=True)
    with HostPool.create(NS, 256, 4, 1, directory=str(pool_dir), huge_pages="on") as pool:
        # fallocate would allocate small pages on a huge=advise tmpfs: reserve comes last.
        assert calls == ["advise", "populate-write", "reserve"]
        calls.clear()
        pool.write(SlotId(1), b"\x05" * 256)
        mapping = attach(pool.descriptor)
        try:
            assert calls == ["advise", "populate-read"]
            assert bytes(mapping.buffer(SlotId(1))) == b"\x05" * 256
        finally:
            mapping.close()
    calls.clear()
    with HostPool.create(NS, 256, 4, 2, directory=str(pool_dir), huge_pages="off"):
        assert calls == ["reserve", "populate-write"]


def test_a_failed_populate_is_a_full_filesystem_not_a_sigbus() -> None:
    class Refusing:
        def __len__(self) -> int:
            return 1 << 21

        def madvise(self, option: int) -> None:
            raise OSError(errno.EFAULT, "Bad address")

    with pytest.raises(LimitExceeded, match="full"):
        pages.populate(Refusing(), write=True)  # type: ignore[arg-type]


def _huge_tmpfs() -> list[str]:
    """Writable tmpfs mounts with huge pages on this host (the test skips without one)."""
    found: list[str] = []
    mounts = Path("/proc/self/mounts").read_text() if os.path.exists("/proc/self/mounts") else ""
    for line in mounts.splitlines():
        parts = line.split()
        huge = len(parts) > 3 and parts[2] == "tmpfs" and "huge=" in parts[3]
        if huge and "huge=never" not in parts[3] and os.access(parts[1], os.W_OK):
            found.append(parts[1])
    return found


@pytest.mark.parametrize(
    "directory",
    _huge_tmpfs()
    or [pytest.param("", marks=pytest.mark.skip(reason="no tmpfs mounted with huge= here"))],
)
def test_a_huge_page_tmpfs_backs_node_and_runner_with_huge_pages(directory: str) -> None:
    size = 4 << 20
    with HostPool.create(NS, 1 << 16, size >> 16, 3, directory=directory) as pool:
        assert pool.huge_page_bytes == size
        mapping = attach(pool.descriptor)
        try:
            assert isinstance(mapping, HostMapping) and mapping.huge_page_bytes == size
            data = np.frombuffer(mapping.buffer(SlotId(5)), dtype=np.uint8)
            data[:] = 9
            assert pool.read(SlotId(5)) == b"\x09" * (1 << 16)
            del data
        finally:
            mapping.close()
