"""The disk tier's read scheduling (`service.disk.reads`): runs of adjacent slots in
one preadv, every block still checked, at most io_threads reads in flight."""

from __future__ import annotations

import asyncio
import errno
import mmap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from service.disk import DiskTier
from service.disk.format import DATA_START, PAGE, SlotHeader, slot_bytes_for
from service.disk.io import TierFile
from service.disk.jobs import ReadResult
from service.disk.reads import RUN_BYTES, SlotRead, plan_runs
from tests.service.disk.test_disk_tier import CAP, REGION, _flip, fill, k, payload


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "tier.disk")


def _header(length: int, h: int = 0) -> SlotHeader:
    return SlotHeader(
        slot_bytes_for(length), 1, b"n" * 16, 0, h.to_bytes(32, "little"), length, 7, h
    )


def test_adjacent_aligned_slots_make_runs_one_per_thread() -> None:
    size = 32 << 10
    slots = mmap.mmap(-1, 9 * size)
    reads = [
        SlotRead.of(
            i,
            _header(size, i),
            DATA_START + PAGE + i * (PAGE + size),
            memoryview(slots)[i * size : (i + 1) * size],
        )
        for i in range(8)
    ]
    runs = plan_runs(reads, threads=4)
    assert [[r.index for r in run] for run in runs] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [len(run) for run in plan_runs(reads, threads=1)] == [8]
    gap = [*reads[:3], SlotRead.of(3, _header(size, 3), reads[3].offset + PAGE, reads[3].dest)]
    assert [len(run) for run in plan_runs(gap, threads=1)] == [3, 1], "not adjacent: apart"
    odd = memoryview(bytearray(size + 1))[1:]  # not page-aligned: through the bounce buffer
    bounce = [*reads[:2], SlotRead.of(2, _header(size, 2), reads[2].offset, odd), reads[3]]
    assert not bounce[2].direct
    assert [[r.index for r in run] for run in plan_runs(bounce, threads=1)] == [[0, 1], [2], [3]]
    big = 1 << 20
    many = [
        SlotRead.of(
            i, _header(big, i), DATA_START + PAGE + i * (PAGE + big), memoryview(mmap.mmap(-1, big))
        )
        for i in range(8)
    ]
    assert all(sum(PAGE + r.want.length for r in run) <= RUN_BYTES for run in plan_runs(many, 1))


def test_matches_is_parse_equality() -> None:
    want = _header(4096, 3)
    page = bytearray(PAGE)
    page[:] = want.pack()
    assert want.matches(page) and SlotHeader.parse(page) == want
    for field in ("epoch", "seq", "checksum", "length"):
        other = _header(4096, 3)
        object.__setattr__(other, field, getattr(other, field) + 1)
        assert not other.matches(page)
    page[40] ^= 1
    assert not want.matches(page) and SlotHeader.parse(page) is None


async def test_a_run_with_a_stale_header_reports_that_block_alone(path: str) -> None:
    # One I/O thread: the chain is one run, one preadv; block 2's header is flipped.
    tier = DiskTier.open(path, CAP, region_bytes=REGION, io_threads=1)
    size = 32 << 10
    blocks = {h: payload(h, size) for h in range(5)}
    await fill(tier, blocks)
    _flip(path, DATA_START + PAGE + 2 * slot_bytes_for(size) + 50)  # block 2's header
    slots = mmap.mmap(-1, 5 * size)
    dests = [memoryview(slots)[i * size : (i + 1) * size] for i in range(5)]
    ok, stale = ReadResult.OK, ReadResult.IDENTITY
    assert await tier.read_many([k(h) for h in range(5)], dests) == [ok, ok, stale, ok, ok]
    assert all(bytes(dests[h]) == blocks[h] for h in (0, 1, 3, 4))
    s = tier.stats()
    assert (s.reads, s.read_failures_identity, s.blocks) == (4, 1, 4)
    await tier.close()


class _CountingFile(TierFile):
    """Counts the reads in flight at once (each held a few ms)."""

    def __init__(self, inner: TierFile) -> None:
        super().__init__(inner.fd, inner.size, inner.direct)
        self.lock = threading.Lock()
        self.now = self.most = 0

    def read_into(self, buffers: list[Any], offset: int) -> int:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.003)
            return super().read_into(buffers, offset)
        finally:
            with self.lock:
                self.now -= 1


async def test_reads_in_flight_never_exceed_io_threads(path: str) -> None:
    files: list[_CountingFile] = []

    def wrap(f: TierFile) -> TierFile:
        files.append(_CountingFile(f))
        return files[-1]

    tier = DiskTier.open(path, CAP, region_bytes=REGION, io_threads=2, wrap=wrap)
    size = 32 << 10
    blocks = {h: payload(h, size) for h in range(12)}
    await fill(tier, blocks)
    slots = mmap.mmap(-1, 12 * size)
    dests = [memoryview(slots)[i * size : (i + 1) * size] for i in range(12)]
    # Four batches at once, and single reads into unaligned buffers (the bounce path).
    singles = [memoryview(bytearray(size)) for _ in range(4)]
    got = await asyncio.gather(
        *(tier.read_many([k(h) for h in range(i, 12, 4)], dests[i::4]) for i in range(4)),
        *(tier.read_into(k(h), singles[h]) for h in range(4)),
    )
    ok = ReadResult.OK
    assert all(all(v is ok for v in g) if isinstance(g, list) else g for g in got)
    assert all(bytes(dests[h]) == blocks[h] for h in range(12))
    assert files[0].most == 2
    await tier.close()


async def test_read_many_gives_each_block_its_own_verdict(path: str) -> None:
    """Issue 40, item 6: a promotion decided "corrupt" from tier-wide counters while up
    to 8 ran at once, so one's checksum failure was blamed on another's failed read.
    `read_many` now says per block: corrupt, failed, absent, or there."""
    size = 32 << 10
    failing: list[int] = []

    class _FailingFile(TierFile):
        def read_into(self, buffers: list[Any], offset: int) -> int:
            end = offset + sum(memoryview(b).nbytes for b in buffers)
            if any(offset <= at < end for at in failing):
                raise OSError(errno.EIO, "the disk is gone")
            return super().read_into(buffers, offset)

    tier = DiskTier.open(
        path,
        CAP,
        region_bytes=REGION,
        io_threads=1,
        wrap=lambda f: _FailingFile(f.fd, f.size, f.direct),
    )
    blocks = {h: payload(h, size) for h in range(3)}
    await fill(tier, blocks)
    slot = slot_bytes_for(size)
    _flip(path, DATA_START + PAGE + slot + PAGE + 50)  # block 1's payload
    failing.append(DATA_START + PAGE + 2 * slot + PAGE + 50)  # block 2's read fails
    dests = [memoryview(bytearray(size)) for _ in range(4)]  # bounced: a read per block
    verdicts = await tier.read_many([k(h) for h in range(4)], dests)  # 3 was never stored
    assert verdicts == [ReadResult.OK, ReadResult.CHECKSUM, ReadResult.ERROR, None]
    await tier.close()
