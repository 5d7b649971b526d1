"""DiskTier on real files (O_DIRECT on the test machine's disk): writes, reads,
reopen, corruption, the cap, the queue, failures and start-up errors."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.checksum import block_checksum
from service.disk import DiskEventKind, DiskKey, DiskTier, DiskTierError
from service.disk.format import DATA_START, PAGE, checkpoint_offset, file_bytes_for, slot_bytes_for
from service.disk.io import TierFile
from service.disk.jobs import ReadResult

NS = b"n" * 16
REGION = 1 << 20
CAP = file_bytes_for(8, REGION)


def payload(seed: int, size: int = 64 << 10) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8).tobytes()


def hb(h: int) -> bytes:
    """The 32-byte block hash the tests name block ``h`` by."""
    return h.to_bytes(32, "little")


def k(h: int, ns: bytes = NS, scope: int = 0) -> DiskKey:
    return DiskKey(ns, scope, hb(h))


def run(tier: DiskTier, scope: int, hashes: list[int]) -> int:
    return tier.run_length(NS, scope, [hb(h) for h in hashes])


async def read(tier: DiskTier, key: DiskKey, size: int) -> bytes | None:
    dest = memoryview(bytearray(size))
    return bytes(dest) if await tier.read_into(key, dest) else None


async def fill(tier: DiskTier, blocks: dict[int, bytes], ns: bytes = NS) -> None:
    for h, data in blocks.items():
        assert tier.offer(k(h, ns), data, block_checksum(data))
        if tier.stats().queue_depth >= 8:
            assert await tier.flush(10)
    assert await tier.flush(10)


def on_disk(path: str) -> tuple[int, int]:
    """(size, bytes allocated) of a file."""
    st = os.stat(path)
    return st.st_size, st.st_blocks * 512


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "tier.disk")


async def test_write_read_and_reopen_byte_exact(path: str) -> None:
    tier = DiskTier.open(path, CAP, region_bytes=REGION)
    blocks = {h: payload(h, 64 << 10) for h in range(20)}
    await fill(tier, blocks)
    assert run(tier, 0, [*range(20), 99]) == 20
    assert run(tier, 1, [0]) == 0, "another scope is another block"
    for h, data in blocks.items():
        assert await read(tier, k(h), len(data)) == data
    events = tier.take_events()
    assert [e.kind for e in events] == [DiskEventKind.STORED] * 20
    await tier.close()
    assert on_disk(path)[0] == CAP

    tier = DiskTier.open(path, CAP, region_bytes=4 << 20)  # a reopened file keeps its regions
    s = tier.stats()
    assert (s.rebuilt_blocks, s.blocks, s.discarded_at_open) == (20, 20, 0)
    assert s.opened_from == "checkpoint"
    assert s.blocks_by_namespace == {NS: 20}
    assert run(tier, 0, list(range(20))) == 20
    for h, data in blocks.items():
        assert await read(tier, k(h), len(data)) == data
    await tier.close()


async def test_aligned_destination_is_read_into_directly(path: str) -> None:
    tier = DiskTier.open(path, CAP, region_bytes=REGION)
    data, odd = payload(1, 256 << 10), payload(2, 10_000)
    tier.offer(k(1), data, 0)  # 0: the tier computes the checksum
    tier.offer(k(2), odd, block_checksum(odd))
    assert await tier.flush(10)
    slot = mmap.mmap(-1, 1 << 20)  # page-aligned, like a pool slot
    assert await tier.read_into(k(1), memoryview(slot)[: len(data)])
    assert slot[: len(data)] == data
    assert await read(tier, k(2), len(odd)) == odd, "a length off the page: bounce buffer"
    with pytest.raises(ValueError):
        await tier.read_into(k(1), memoryview(bytearray(5)))
    assert tier.length_of(k(2)) == len(odd) and tier.length_of(k(3)) is None
    await tier.close()


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


async def test_flipped_payload_bit_is_a_miss_counted_and_discarded(path: str) -> None:
    tier = DiskTier.open(path, CAP, region_bytes=REGION, direct=True)
    data = payload(3)
    tier.offer(k(1), data, block_checksum(data))
    assert await tier.flush(10)
    _flip(path, DATA_START + PAGE + PAGE + 1234)  # region 0, slot 0, into the payload
    assert await read(tier, k(1), len(data)) is None
    s = tier.stats()
    assert (s.read_failures_checksum, s.blocks) == (1, 0)
    assert [e.kind for e in tier.take_events()] == [DiskEventKind.STORED, DiskEventKind.REMOVED]
    assert await tier.flush(10)  # its header zeroed behind
    await tier.close()
    tier = DiskTier.open(path, CAP)
    assert tier.stats().blocks == 0, "a discarded block does not come back"
    await tier.close()


async def test_torn_header_is_discarded_at_open(path: str) -> None:
    tier = DiskTier.open(path, CAP, region_bytes=REGION)
    await fill(tier, {h: payload(h) for h in range(3)})
    await tier.close(checkpoint=False)  # as after a crash: the next open scans
    size = slot_bytes_for(64 << 10)
    _flip(path, DATA_START + PAGE + size + 40)  # slot 1's header
    tier = DiskTier.open(path, CAP)
    s = tier.stats()
    assert (s.blocks, s.discarded_at_open) == (2, 1)
    assert run(tier, 0, [0, 1, 2]) == 1
    assert await read(tier, k(2), 64 << 10) == payload(2)
    await tier.close()


async def test_a_block_offered_twice_is_written_once(path: str) -> None:
    tier = DiskTier.open(path, CAP, region_bytes=REGION)
    data = payload(4)
    assert tier.offer(k(1), data, block_checksum(data))
    assert not tier.offer(k(1), data, block_checksum(data)), "queued already"
    assert await tier.flush(10)
    assert not tier.offer(k(1), data, block_checksum(data)), "on disk already"
    s = tier.stats()
    assert (s.writes, s.write_present, s.blocks) == (1, 2, 1)
    await tier.close()


async def test_cap_holds_with_ten_namespaces_of_different_block_sizes(path: str) -> None:
    # 16 regions of 256 KiB: each size can hold one or two at a time (a region holds
    # one slot size, so there must be more regions than sizes), 2.5x over-subscribed.
    cap = file_bytes_for(16, 256 << 10)
    tier = DiskTier.open(path, cap, region_bytes=256 << 10)
    written: dict[DiskKey, bytes] = {}
    sizes = [(4 << 10) * (i + 1) + 100 * i for i in range(10)]
    for rnd in range(60):
        # Rotated: a size with no region takes one only when no I/O is in flight on it,
        # so a size late in every round would only ever be refused.
        for i in [*range(rnd % 10, 10), *range(rnd % 10)]:
            size = sizes[i]
            ns = bytes([i]) * 16
            data = payload(rnd * 10 + i, size)
            key = k(rnd, ns)
            if tier.offer(key, data, block_checksum(data)):
                written[key] = data
        assert await tier.flush(10)
        s = tier.stats()
        size, allocated = on_disk(path)
        assert s.used_bytes <= s.file_bytes <= cap and size <= cap
        # Allocated on disk: the file plus the file system's own extent blocks.
        assert allocated <= cap + (64 << 10)
    s = tier.stats()
    assert s.evictions > 0 and len(s.blocks_by_namespace) == 10
    assert sum(len(d) for d in written.values()) > 2 * cap
    for key, data in written.items():
        if tier.length_of(key) is not None:
            assert await read(tier, key, len(data)) == data
    await tier.close()


async def test_lru_evicts_the_least_recently_used_block(path: str) -> None:
    # One I/O thread: blocks become readable (most recent) in the order they were offered.
    tier = DiskTier.open(path, file_bytes_for(1, REGION), region_bytes=REGION, io_threads=1)
    size = 60 << 10  # 16 slots of 64 KiB in a 1 MiB region, less its header page: 15
    await fill(tier, {h: payload(h, size) for h in range(15)})
    assert await read(tier, k(0), size) == payload(0, size)  # 0 is now the most recent
    tier.take_events()
    await fill(tier, {100: payload(100, size)})
    assert run(tier, 0, [0]) == 1 and run(tier, 0, [1]) == 0
    removed = [
        int.from_bytes(e.key.block_hash, "little")
        for e in tier.take_events()
        if e.kind is DiskEventKind.REMOVED
    ]
    assert removed == [1]
    await tier.close()


async def test_full_queue_drops_and_counts_without_blocking(path: str) -> None:
    tier = DiskTier.open(path, CAP, region_bytes=REGION, queue_blocks=4, io_threads=1)
    data = payload(5)
    took = [tier.offer(k(h), data, block_checksum(data)) for h in range(10)]
    assert took == [True] * 4 + [False] * 6, "no await between offers: nothing completed"
    assert tier.stats().write_drops == 6 and tier.stats().queue_depth == 4
    assert await tier.flush(10)
    assert tier.stats().blocks == 4
    await tier.close()


class FailingFile(TierFile):
    """The tier file, with writes failing after ``ok`` of them (the I/O seam)."""

    def __init__(self, inner: TierFile, ok: int, err: int) -> None:
        super().__init__(inner.fd, inner.size, inner.direct)
        self.ok, self.err = ok, err

    def write(self, buffers: list[object], offset: int) -> None:
        if self.ok <= 0:
            raise OSError(self.err, os.strerror(self.err))
        self.ok -= 1
        super().write(buffers, offset)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
async def test_write_failure_degrades_the_tier_reads_go_on(
    path: str, err: int, caplog: pytest.LogCaptureFixture
) -> None:
    # Two writes succeed (region header + first slot), then every write fails.
    tier = DiskTier.open(path, CAP, region_bytes=REGION, wrap=lambda f: FailingFile(f, 2, err))
    good, bad = payload(6), payload(7)
    assert tier.offer(k(1), good, block_checksum(good))
    assert await tier.flush(10)
    assert tier.offer(k(2), bad, block_checksum(bad))
    await tier.flush(10)
    s = tier.stats()
    # The block's write failed, then the zeroing of its slot's header did too.
    assert s.degraded and s.write_errors == 2 and s.enospc == (2 if err == errno.ENOSPC else 0)
    assert run(tier, 0, [1, 2]) == 1, "a failed write leaves no entry"
    assert not tier.offer(k(3), bad, block_checksum(bad)), "degraded: no more writes"
    assert await read(tier, k(1), len(good)) == good
    assert sum("degraded" in r.message for r in caplog.records) == 1
    await tier.close()


async def test_dropped_namespace_stays_dropped_after_reopen(path: str) -> None:
    tier = DiskTier.open(path, CAP, region_bytes=REGION)
    other = b"o" * 16
    await fill(tier, {h: payload(h) for h in range(4)})
    await fill(tier, {h: payload(h) for h in range(2)}, ns=other)
    assert tier.drop_namespace(NS) == 4
    assert tier.stats().blocks_by_namespace == {other: 2}
    assert await tier.flush(10)
    await tier.close()
    tier = DiskTier.open(path, CAP)
    assert tier.stats().blocks_by_namespace == {other: 2}
    await tier.close()


class HeldReads(TierFile):
    """Reads wait for ``release`` (set from the test) once ``held`` is set."""

    def __init__(self, inner: TierFile) -> None:
        super().__init__(inner.fd, inner.size, inner.direct)
        self.held, self.entered, self.release = (threading.Event() for _ in range(3))

    def read_into(self, buffers: list[Any], offset: int) -> int:
        if self.held.is_set():
            self.entered.set()
            assert self.release.wait(10)
        return super().read_into(buffers, offset)


async def test_cancelled_read_waits_for_its_io_and_leaves_the_block(path: str) -> None:
    files: list[HeldReads] = []

    def wrap(inner: TierFile) -> HeldReads:
        files.append(HeldReads(inner))
        return files[-1]

    tier = DiskTier.open(path, CAP, region_bytes=REGION, wrap=wrap)
    (file,) = files
    data = payload(8)
    await fill(tier, {1: data})
    file.held.set()
    task = asyncio.ensure_future(read(tier, k(1), len(data)))
    await asyncio.to_thread(file.entered.wait, 10)  # the read is in the kernel's hands
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done(), "a cancelled read returns only once its I/O has landed"
    file.held.clear()
    file.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await read(tier, k(1), len(data)) == data
    await tier.close()


# -- start-up errors ------------------------------------------------------------


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(DiskTierError, match=r"disk_path .*does not exist; create it"):
        DiskTier.open(str(tmp_path / "nope" / "tier.disk"), CAP)


def test_capacity_too_small_or_beyond_the_free_space(path: str) -> None:
    with pytest.raises(DiskTierError, match="disk_capacity_bytes 1000 is too small"):
        DiskTier.open(path, 1000)
    with pytest.raises(DiskTierError, match=r"more than the .* bytes free"):
        DiskTier.open(path, 1 << 60)
    assert not os.path.exists(path), "a failed open leaves no file behind"


def test_a_file_that_is_not_a_tier_is_refused(path: str) -> None:
    Path(path).write_bytes(b"precious data" * 1000)
    with pytest.raises(DiskTierError, match="is not a kvstore disk tier file"):
        DiskTier.open(path, CAP)
    assert Path(path).read_bytes() == b"precious data" * 1000


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[object]:
    mounted: list[Path] = []

    def do(fs: str, options: str) -> Path:
        where = tmp_path / fs
        where.mkdir()
        run = subprocess.run(
            ["mount", "-t", fs, "-o", options, fs, str(where)], capture_output=True
        )
        if run.returncode:
            pytest.skip(f"cannot mount {fs} here: {run.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield do
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


def test_no_o_direct_is_a_start_up_error(mount: object) -> None:
    # ramfs: no O_DIRECT (tmpfs has it since Linux 6.6, so /dev/shm no longer shows this).
    where = mount("ramfs", "size=16m")  # type: ignore[operator]
    with pytest.raises(
        DiskTierError, match=r"\(ramfs\) does not support O_DIRECT; .*disk_direct_io = false"
    ):
        DiskTier.open(str(where / "tier.disk"), CAP)
    tier = DiskTier.open(str(where / "tier.disk"), CAP, direct=False, region_bytes=REGION)
    asyncio.run(tier.close())


def test_unwritable_path(mount: object) -> None:
    where = mount("tmpfs", "ro,size=1m")  # type: ignore[operator]
    with pytest.raises(
        DiskTierError, match=r"cannot be written .*give the node's user write access"
    ):
        DiskTier.open(str(where / "tier.disk"), CAP)


# -- the checkpoint of a clean stop ------------------------------------------------


async def test_checkpoint_keeps_the_lru_order_and_goes_stale_once_opened(path: str) -> None:
    tier = DiskTier.open(path, file_bytes_for(1, REGION), region_bytes=REGION, io_threads=1)
    size = 60 << 10  # 15 slots
    await fill(tier, {h: payload(h, size) for h in range(15)})
    assert await read(tier, k(0), size) == payload(0, size)  # 0 is the most recent
    await tier.close()

    tier = DiskTier.open(path, file_bytes_for(1, REGION), io_threads=1)
    assert tier.stats().opened_from == "checkpoint"
    await fill(tier, {100: payload(100, size)})  # evicts 1, not 0 (reads count after a restart)
    assert run(tier, 0, [0]) == 1 and run(tier, 0, [1]) == 0
    # Not closed (a crash): the next open must not believe the old checkpoint.
    await tier.flush(10)
    crashed = DiskTier.open(path, file_bytes_for(1, REGION))
    s = crashed.stats()
    assert s.opened_from == "headers" and s.blocks == 15
    assert run(crashed, 0, [100, 0, 2]) == 3 and run(crashed, 0, [1]) == 0
    assert await read(crashed, k(100), size) == payload(100, size)
    await crashed.close()
    await tier.close(checkpoint=False)


async def test_a_corrupt_checkpoint_falls_back_to_the_headers(path: str) -> None:
    tier = DiskTier.open(path, CAP, region_bytes=REGION)
    await fill(tier, {h: payload(h) for h in range(5)})
    await tier.close()
    _flip(path, checkpoint_offset(8, REGION) + PAGE + 10)  # its first record
    tier = DiskTier.open(path, CAP)
    s = tier.stats()
    assert (s.opened_from, s.blocks) == ("headers", 5)
    await tier.close()


async def test_reopened_with_another_capacity(path: str) -> None:
    tier = DiskTier.open(path, file_bytes_for(4, REGION), region_bytes=REGION)
    big = 200 << 10  # 5 slots a region: blocks 0-4 in region 0, 5-7 in region 1
    await fill(tier, {h: payload(h, big) for h in range(8)})
    await tier.close()
    tier = DiskTier.open(path, file_bytes_for(6, REGION))  # grown: kept, scanned
    s = tier.stats()
    assert (s.blocks, s.file_bytes, s.opened_from) == (8, file_bytes_for(6, REGION), "headers")
    await tier.close()
    tier = DiskTier.open(path, file_bytes_for(1, REGION))  # shrunk: region 1 is gone
    assert on_disk(path)[0] == file_bytes_for(1, REGION)
    assert run(tier, 0, list(range(8))) == 5
    assert await read(tier, k(4), big) == payload(4, big)
    await tier.close()


async def test_read_many_reads_a_chain_and_reports_each_block(path: str) -> None:
    tier = DiskTier.open(path, CAP, region_bytes=REGION)
    blocks = {h: payload(h, 32 << 10) for h in range(6)}
    await fill(tier, blocks)
    _flip(path, DATA_START + PAGE + 2 * slot_bytes_for(32 << 10) + PAGE + 7)  # block 2's payload
    slots = mmap.mmap(-1, 8 * (32 << 10))
    dests = [memoryview(slots)[i * (32 << 10) : (i + 1) * (32 << 10)] for i in range(7)]
    got = await tier.read_many([k(h) for h in range(7)], dests)  # 6 is not on disk
    ok = ReadResult.OK
    assert got == [ok, ok, ReadResult.CHECKSUM, ok, ok, ok, None]
    assert all(bytes(dests[h]) == blocks[h] for h in (0, 1, 3, 4, 5))
    s = tier.stats()
    assert (s.reads, s.read_failures_checksum, s.blocks) == (5, 1, 5)
    with pytest.raises(ValueError):
        await tier.read_many([k(0), k(1)], [dests[0], memoryview(bytearray(3))])
    assert tier.stats().reads == 5, "a bad destination reads nothing"
    assert await tier.read_many([], []) == []
    await tier.close()


async def test_reserve_write_then_submit_or_cancel(path: str) -> None:
    tier = DiskTier.open(path, CAP, region_bytes=REGION, queue_blocks=2)
    a, b = payload(21), payload(22)
    first = tier.reserve_write(k(1), len(a), block_checksum(a))
    second = tier.reserve_write(k(2), len(b), 0)
    assert first is not None and second is not None
    assert tier.reserve_write(k(3), len(b), 0) is None, "the queue holds reservations"
    first.payload[:] = a
    second.payload[:] = b  # copied, but torn: given back
    tier.submit_write(first)
    tier.cancel_write(second)
    assert await tier.flush(10)
    s = tier.stats()
    assert (s.blocks, s.writes, s.queue_depth, s.write_drops) == (1, 1, 0, 1)
    assert await read(tier, k(1), len(a)) == a and tier.length_of(k(2)) is None
    late = tier.reserve_write(k(4), len(a), 0)
    assert late is not None
    await tier.close()
    tier.submit_write(late)  # after close: dropped, never written
    tier = DiskTier.open(path, CAP)
    assert tier.length_of(k(1)) == len(a) and tier.length_of(k(4)) is None
    await tier.close()
