"""How the disk tier's reads run: few tasks, adjacent slots in one ``preadv``,
verification beside the I/O rather than in its slot.

`DiskTier.read_many` hands a batch of `SlotRead`\\ s to `SlotReader.submit`:

- **Runs.** Blocks whose slots lie back to back in the file (a chain's
  blocks, written one after the other, mostly do) and whose destinations
  are page-aligned whole pages are read by one ``preadv`` of
  ``[header, payload, header, payload, ...]``, up to `RUN_BYTES`; a batch
  is cut into at least as many runs as there are I/O threads when it has
  the blocks, so a chain keeps every thread busy.
- **Lanes.** One task per I/O thread (at most) reads its share of the runs
  in a loop: a 16-block chain is a handful of Python tasks, not 16.
- **Verification outside the I/O slot.** ``io_threads`` I/Os are in flight
  at most (a semaphore, fio's iodepth); the pool has `VERIFY_THREADS` more
  threads, so the thread that read lets go of its slot, checks the run
  (header identity, payload xxh3-64) and another thread starts the next
  read meanwhile: no extra hop between threads. A block is reported OK only
  after both checks passed; the batch's future is set only when every
  block of it has been checked, so nothing writes into a destination after
  `read_many` returns (it waits, even when cancelled).

A destination that is not page-aligned goes through the reading thread's
bounce buffer and is checked and copied in that thread (its own run).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from kvstore.checksum import block_checksum
from service.disk.entry import Entry
from service.disk.format import PAGE, DiskKey, SlotHeader, round_up
from service.disk.io import TierFile, address_of, aligned
from service.disk.jobs import Completions, ReadBatch, ReadResult, ThreadBuffers

log = logging.getLogger(__name__)

RUN_BYTES = 4 << 20
"""Most bytes one ``preadv`` of adjacent slots reads (a bigger run would leave
threads idle on a short chain, and holds more header pages)."""

VERIFY_THREADS = 2
"""Threads beyond ``io_threads`` in the tier's pool: a thread that read lets go of its I/O
slot and checks the blocks (xxh3 runs at ~17 GB/s, GIL released) while another thread
takes the slot for the next read; ``io_threads`` I/Os stay in flight, as fio's iodepth."""


@dataclass(slots=True)
class SlotRead:
    """One block of a batch: where it is, what its header must be, where it goes."""

    index: int
    """Its position in the batch (`ReadBatch.results`)."""
    want: SlotHeader
    offset: int
    dest: memoryview
    direct: bool
    """Read straight into ``dest`` (page-aligned, whole pages), else via a bounce buffer."""

    @classmethod
    def of(cls, index: int, want: SlotHeader, offset: int, dest: memoryview) -> SlotRead:
        dest = dest.cast("B")
        n = want.length
        direct = n > 0 and n % PAGE == 0 and address_of(dest) % PAGE == 0
        return cls(index, want, offset, dest, direct)

    @property
    def end(self) -> int:
        """The file offset just past this slot's header and payload."""
        return self.offset + PAGE + self.want.length


class HeaderPages:
    """Header pages for reads in flight, reused (``deque`` pops and appends are
    atomic: threads take and give back without a lock)."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: deque[Any] = deque()

    def take(self, n: int) -> list[Any]:
        out = []
        for _ in range(n):
            try:
                out.append(self._free.pop())
            except IndexError:
                out.append(aligned(PAGE))
        return out

    def give_back(self, pages: list[Any]) -> None:
        for page in pages:
            if len(self._free) < self._keep:
                self._free.append(page)
            else:
                page.close()


def plan_runs(reads: list[SlotRead], threads: int) -> list[list[SlotRead]]:
    """Cut a batch into runs of adjacent direct slots, each read by one ``preadv``."""
    most = max(1, -(-len(reads) // max(1, threads)))  # at least `threads` runs when it can
    runs: list[list[SlotRead]] = []
    run: list[SlotRead] = []
    run_bytes = 0
    for r in sorted(reads, key=lambda r: r.offset):
        size = PAGE + r.want.length
        direct = r.direct
        joins = (
            run
            and direct
            and run[-1].end == r.offset
            and len(run) < most
            and run_bytes + size <= RUN_BYTES
        )
        if joins:
            run.append(r)
            run_bytes += size
            continue
        if run:
            runs.append(run)
        run, run_bytes = [r], size
        if not direct:
            runs.append(run)
            run, run_bytes = [], 0
    if run:
        runs.append(run)
    return runs


class SlotReader:
    """Runs a batch's reads on the I/O pool and their checks on the verification pool."""

    def __init__(
        self,
        file: TierFile,
        io_pool: Executor,
        io_threads: int,
        io_slots: threading.Semaphore,
        local: ThreadBuffers,
    ) -> None:
        self._file = file
        self._io = io_pool
        self._threads = io_threads
        self._slots = io_slots
        self._local = local
        self._pages = HeaderPages(keep=64 * io_threads)

    def submit(self, done: Completions, batch: ReadBatch, reads: list[SlotRead]) -> None:
        """Start a batch's reads (on the loop's thread); the last check wakes the loop."""
        runs = plan_runs(reads, self._threads)
        lanes = min(self._threads, len(runs))
        for lane in range(lanes):
            self._io.submit(self._lane, done, batch, runs[lane::lanes])

    def _lane(self, done: Completions, batch: ReadBatch, runs: list[list[SlotRead]]) -> None:
        """On an I/O thread: its runs one after the other."""
        for run in runs:
            if not run[0].direct:
                try:
                    with self._slots:
                        result = self._bounced(run[0])
                except BaseException:
                    log.exception("disk tier: bug in a read")
                    result = ReadResult.ERROR
                self._finish(done, batch, run, [result])
                continue
            pages = self._pages.take(len(run))
            with self._slots:  # the I/O slot: held for the read, not for its check
                got = self._read_run(run, pages)
            self._check(done, batch, run, pages, got)

    def _read_run(self, run: list[SlotRead], pages: list[Any]) -> int:
        """One ``preadv`` of the run; the bytes read, -1 on an I/O error (logged)."""
        buffers: list[Any] = []
        for r, page in zip(run, pages, strict=True):
            buffers += (page, r.dest)
        try:
            return self._file.read_into(buffers, run[0].offset)
        except OSError as exc:
            log.warning("disk tier: reading block %s failed (%s)", run[0].want.block_hash, exc)
        except BaseException:
            log.exception("disk tier: bug in a read")
        return -1

    def _check(
        self,
        done: Completions,
        batch: ReadBatch,
        run: list[SlotRead],
        pages: list[Any],
        got: int,
    ) -> None:
        """Header identity and payload checksum of each block of a run that was read."""
        results: list[ReadResult] = []
        start = run[0].offset
        try:
            for r, page in zip(run, pages, strict=True):
                if got < 0:
                    results.append(ReadResult.ERROR)
                else:
                    results.append(_verdict(r.want, got >= r.end - start, page, r.dest))
        except BaseException:  # never OK unchecked, and the batch still ends
            log.exception("disk tier: bug in a read's check")
            results = [ReadResult.ERROR] * len(run)
        self._pages.give_back(pages)
        self._finish(done, batch, run, results)

    def _bounced(self, r: SlotRead) -> ReadResult:
        """A destination the kernel cannot read into directly: through the bounce buffer."""
        length = r.want.length
        padded = round_up(length) if length else PAGE
        local = self._local
        bounce = memoryview(local.bounce_of(padded))[:padded]
        try:
            got = self._file.read_into([local.page, bounce], r.offset)
        except OSError as exc:
            log.warning("disk tier: reading block %s failed (%s)", r.want.block_hash, exc)
            return ReadResult.ERROR
        payload = bounce[:length]
        result = _verdict(r.want, got >= PAGE + length, local.page, payload)
        if result is ReadResult.OK:
            r.dest.cast("B")[:] = payload
        return result

    @staticmethod
    def _finish(
        done: Completions, batch: ReadBatch, run: list[SlotRead], results: list[ReadResult]
    ) -> None:
        for r, result in zip(run, results, strict=True):
            batch.results[r.index] = result
        with batch.lock:
            batch.left -= len(run)
            last = batch.left == 0
        if last:
            done.post(batch.finish)


def _verdict(want: SlotHeader, whole: bool, page: Any, payload: Any) -> ReadResult:
    """A block read (``whole``: all of its slot arrived): its header must be ``want``
    (identity), then its payload must have the checksum. OK only after both."""
    if not whole or not want.matches(page):
        return ReadResult.IDENTITY
    if block_checksum(payload) != want.checksum:
        return ReadResult.CHECKSUM
    return ReadResult.OK


_FAILURE_COUNTER = {
    ReadResult.IDENTITY: "read_failures_identity",
    ReadResult.CHECKSUM: "read_failures_checksum",
    ReadResult.ERROR: "read_errors",
}


def count_read(counters: dict[str, int], e: Entry | None, result: ReadResult | None) -> bool:
    """Count a block's read in the tier's counters (a failure logged); whether it is OK."""
    if e is None or result is None:
        return False
    if result is ReadResult.OK:
        counters["reads"] += 1
        counters["read_bytes"] += e.length
        return True
    counters[_FAILURE_COUNTER[result]] += 1
    log.warning("disk tier: block %s discarded (%s)", DiskKey(*e.key), _FAILURE_COUNTER[result])
    return False
