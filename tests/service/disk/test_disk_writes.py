"""The disk tier's write lanes (`service.disk.writes`): blocks queued in adjacent slots go
down in one pwritev, each still reported, failed, skipped and checked on its own."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from kvstore.checksum import block_checksum
from service.disk import DiskTier
from service.disk.format import PAGE, slot_bytes_for
from service.disk.io import TierFile
from tests.service.disk.test_disk_tier import CAP, NS, REGION, k, payload, read, run

SIZE = 32 << 10
SLOT = slot_bytes_for(SIZE)


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "tier.disk")


class GatedFile(TierFile):
    """Records every write (offset, buffer sizes); the first write waits for ``release``,
    so the blocks offered meanwhile queue up behind it. ``fail`` fails writes of more than
    one buffer (a coalesced run); ``tear`` writes half of such a run, then fails."""

    def __init__(self, inner: TierFile, fail: int = 0, tear: bool = False) -> None:
        super().__init__(inner.fd, inner.size, inner.direct)
        self.calls: list[tuple[int, list[int]]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail, self.tear = fail, tear
        self.broken = False

    def write(self, buffers: list[Any], offset: int) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(10)
        if self.broken:
            raise OSError(errno.EIO, "the disk is gone")
        sizes = [len(memoryview(b)) for b in buffers]
        self.calls.append((offset, sizes))
        if len(buffers) > 1 and self.tear:
            self.broken = True  # a crash mid-run: nothing written after
            first, second = memoryview(buffers[0]), memoryview(buffers[1])
            super().write([first, second[: len(second) // 2]], offset)
            raise OSError(errno.EIO, "torn")
        if len(buffers) > 1 and self.fail:
            raise OSError(self.fail, os.strerror(self.fail))
        super().write(buffers, offset)

    def slot_writes(self) -> list[tuple[int, list[int]]]:
        """The writes of whole slots (not a header page zeroed, not a region header)."""
        return [(o, s) for o, s in self.calls if s[0] == SLOT]


def _open(path: str, io_threads: int = 1, **kw: Any) -> tuple[DiskTier, GatedFile]:
    files: list[GatedFile] = []

    def wrap(f: TierFile) -> TierFile:
        files.append(GatedFile(f, **kw))
        return files[-1]

    tier = DiskTier.open(path, CAP, region_bytes=REGION, io_threads=io_threads, wrap=wrap)
    return tier, files[0]


async def _hold(tier: DiskTier, file: GatedFile, h: int = 100) -> bytes:
    """Offer a block of another namespace and wait until its write holds the lane."""
    first = payload(h, SIZE)
    assert tier.offer(k(h, b"o" * 16), first, block_checksum(first))
    assert await asyncio.to_thread(file.entered.wait, 10)
    return first


async def test_adjacent_queued_slots_go_down_in_one_pwritev(path: str) -> None:
    tier, file = _open(path)
    await _hold(tier, file)
    blocks = {h: payload(h, SIZE) for h in range(8)}
    for h, data in blocks.items():
        assert tier.offer(k(h), data, block_checksum(data))
    file.release.set()
    assert await tier.flush(10)
    runs = file.slot_writes()
    assert [len(s) for _, s in runs] == [1, 8], "the held block, then the 8 queued in one"
    assert runs[1][1] == [SLOT] * 8 and runs[1][0] == runs[0][0] + SLOT
    s = tier.stats()
    assert (s.writes, s.write_bytes, s.blocks, s.queue_depth) == (9, 9 * SIZE, 9, 0)
    await tier.close(checkpoint=False)  # the next open scans the slot headers, one by one
    tier = DiskTier.open(path, CAP)
    assert tier.stats().rebuilt_blocks == 9
    assert run(tier, 0, list(range(8))) == 8
    for h, data in blocks.items():
        assert await read(tier, k(h), SIZE) == data
    await tier.close()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
async def test_a_failed_run_fails_each_of_its_blocks_and_degrades(path: str, err: int) -> None:
    tier, file = _open(path, fail=err)
    first = await _hold(tier, file)
    for h in range(4):
        data = payload(h, SIZE)
        assert tier.offer(k(h), data, block_checksum(data))
    file.release.set()
    assert await tier.flush(10)
    s = tier.stats()
    assert s.degraded and s.write_errors == 4 and s.enospc == (4 if err == errno.ENOSPC else 0)
    assert (s.writes, s.blocks, s.queue_depth) == (1, 1, 0)
    assert run(tier, 0, [0, 1, 2, 3]) == 0, "no block of the failed run is on disk"
    assert [len(s) for _, s in file.slot_writes()] == [1, 4]
    assert await read(tier, k(100, b"o" * 16), SIZE) == first, "reads go on"
    await tier.close()


async def test_a_cancelled_or_dropped_block_is_not_written(path: str) -> None:
    tier, file = _open(path)
    await _hold(tier, file)
    pending = [tier.reserve_write(k(h), SIZE, 0) for h in range(6)]
    blocks = {h: payload(h, SIZE) for h in range(6)}
    for h, p in enumerate(pending):
        assert p is not None
        p.payload[:] = blocks[h]
        if h == 2:
            tier.cancel_write(p)  # a torn copy: given back, never queued
        else:
            tier.submit_write(p)
    file.release.set()
    assert await tier.flush(10)
    first = file.slot_writes()[1][0]
    assert [(o - first, s) for o, s in file.slot_writes()[1:]] == [
        (0, [SLOT] * 2),
        (3 * SLOT, [SLOT] * 3),
    ], "blocks 0-1 in one write, 3-5 in another; block 2's slot only has its header zeroed"
    assert [s for o, s in file.calls if o == first + 2 * SLOT] == [[PAGE]]
    assert [await read(tier, k(h), SIZE) == blocks[h] for h in range(6)] == [True] * 2 + [False] + [
        True
    ] * 3

    # Dropped while queued: the queued blocks of the namespace are skipped, not written.
    file.entered.clear()
    file.release.clear()
    await _hold(tier, file, 101)
    more = {h: payload(h, SIZE) for h in range(10, 14)}
    for h, data in more.items():
        assert tier.offer(k(h), data, block_checksum(data))
    calls = len(file.slot_writes())
    assert tier.drop_namespace(NS) == 9  # the 5 on disk, the 4 queued
    file.release.set()
    assert await tier.flush(10)
    assert [len(s) for _, s in file.slot_writes()[calls:]] == [1], "the held block only"
    s = tier.stats()
    assert (s.blocks, s.queue_depth, s.write_errors, s.degraded) == (2, 0, 0, False)
    await tier.close()


async def test_a_run_torn_mid_way_loses_only_the_torn_slot(path: str) -> None:
    tier, file = _open(path, tear=True)
    await _hold(tier, file)
    blocks = {h: payload(h, SIZE) for h in range(3)}
    for h, data in blocks.items():
        assert tier.offer(k(h), data, block_checksum(data))
    file.release.set()
    assert await tier.flush(10)
    assert tier.stats().degraded
    await tier.close()  # degraded: no checkpoint, the next open scans (a crash's path)
    tier = DiskTier.open(path, CAP)
    # Block 0 landed whole before the tear: its own header and checksum vouch for it.
    assert await read(tier, k(0), SIZE) == blocks[0]
    # Block 1's header landed, half its payload: its checksum never lets it be served.
    assert await read(tier, k(1), SIZE) is None
    assert await read(tier, k(2), SIZE) is None
    s = tier.stats()
    assert s.read_failures_checksum + s.read_failures_identity + s.discarded_at_open >= 1
    await tier.close()


async def test_writes_in_flight_never_exceed_io_threads(path: str) -> None:
    lock = threading.Lock()
    now = most = 0

    class Counting(TierFile):
        def __init__(self, inner: TierFile) -> None:
            super().__init__(inner.fd, inner.size, inner.direct)

        def write(self, buffers: list[Any], offset: int) -> None:
            nonlocal now, most
            with lock:
                now += 1
                most = max(most, now)
            try:
                threading.Event().wait(0.002)
                super().write(buffers, offset)
            finally:
                with lock:
                    now -= 1

    tier = DiskTier.open(path, CAP, region_bytes=REGION, io_threads=2, wrap=Counting)
    blocks = {h: payload(h, SIZE) for h in range(24)}
    for h, data in blocks.items():
        assert tier.offer(k(h), data, block_checksum(data))
    assert await tier.flush(10)
    assert most == 2 and tier.stats().blocks == 24
    assert all([await read(tier, k(h), SIZE) == d for h, d in blocks.items()])
    await tier.close()
