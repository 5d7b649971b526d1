"""How the disk tier's writes run: blocks queued in adjacent slots go down in one ``pwritev``.

`DiskTier.submit_write` puts a filled `PendingWrite` on `WriteLanes`' queue:

- **Runs.** A lane takes the queue's head and the blocks queued right after it whose slots
  follow it in the file (a chain committed at once is reserved slot after slot in a
  region, and submitted in that order), up to `RUN_BYTES`, `IOV_MAX` blocks, and a share
  of the queue (at least as many runs as threads when the queue has the blocks, so a
  chain keeps every thread busy). Each block's buffer is already its whole slot, header
  page then payload, so the run is one ``pwritev`` of ``[slot, slot, ...]``.
- **Per block, as before.** Each slot keeps its own header (identity, sequence, payload
  checksum): a write torn anywhere in the run is caught slot by slot at the next open.
  The writes that must come first (a region's header, a reused slot's old header zeroed)
  go before the run's ``pwritev``. Each block is reported on its own (`Completions`); a
  failed run fails every block in it, as a failed single write would (the tier then
  degrades). A block dropped before its write is not written (its slot's pre-writes still
  are: a region header others rely on, an evicted block's header zeroed).
- **Lanes.** At most ``io_threads`` lanes, each a task on the write pool that writes one
  run and submits itself again (behind the header invalidations queued meanwhile); the
  I/O slot (the semaphore shared with reads) is held for a run's writes only, the
  checksums and headers are computed before.

One lane (``io_threads`` = 1) writes in the order submitted.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor

from kvstore.checksum import NOT_COMPUTED, block_checksum
from service.disk.format import PAGE, SlotHeader
from service.disk.io import TierFile
from service.disk.jobs import PendingWrite, ThreadBuffers

RUN_BYTES = 4 << 20
"""Most payload bytes one ``pwritev`` of adjacent slots writes (their header pages come on
top: four 1 MiB blocks are one run), as a read run (`reads.RUN_BYTES`)."""

try:
    IOV_MAX = max(1, min(1024, os.sysconf("SC_IOV_MAX")))
except (ValueError, OSError):  # pragma: no cover (Linux has it)
    IOV_MAX = 1024
"""Most buffers one ``pwritev`` takes: one per block."""

WriteDone = Callable[[PendingWrite, "int | None", "BaseException | None"], None]
"""Called on the loop per block: its checksum (None: not written) and the error, if any."""


def _adjacent(run: list[PendingWrite], nxt: PendingWrite) -> bool:
    last = run[-1].res
    return nxt.res.offset == last.offset + last.slot_bytes


def _stretches(live: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each stretch of live blocks in a run (one, unless a block was dropped)."""
    out: list[tuple[int, int]] = []
    start = -1
    for i, alive in enumerate([*live, False]):
        if alive and start < 0:
            start = i
        elif not alive and start >= 0:
            out.append((start, i))
            start = -1
    return out


class WriteLanes:
    """The write-behind's queue of filled blocks, and the lanes that write it in runs."""

    def __init__(
        self,
        file: TierFile,
        pool: Executor,
        threads: int,
        io_slots: threading.Semaphore,
        local: ThreadBuffers,
        scope_names: dict[int, bytes],
        on_done: WriteDone,
    ) -> None:
        self._file = file
        self._pool = pool
        self._threads = threads
        self._slots = io_slots
        self._local = local
        self._scope_names = scope_names
        self._on_done = on_done
        self._queue: deque[PendingWrite] = deque()
        self._lock = threading.Lock()  # the queue and the lane count only, never held for I/O
        self._lanes = 0
        self.closed = False
        """Set by the tier's close: queued blocks are reported unwritten, with no I/O."""

    def put(self, pending: PendingWrite) -> None:
        """Queue a filled block (on the loop); start a lane if fewer than ``threads`` run."""
        with self._lock:
            self._queue.append(pending)
            start = self._lanes < self._threads
            if start:
                self._lanes += 1
        if start:
            self._pool.submit(self._lane)

    def _take(self) -> list[PendingWrite]:
        """The next run off the queue; empty (and this lane ended) when there is none."""
        with self._lock:
            queue = self._queue
            if not queue:
                self._lanes -= 1
                return []
            most = min(IOV_MAX, -(-len(queue) // self._threads))
            run = [queue.popleft()]
            size = run[0].length
            while queue and len(run) < most:
                nxt = queue[0]
                if not _adjacent(run, nxt) or size + nxt.length > RUN_BYTES:
                    break
                run.append(queue.popleft())
                size += nxt.length
            return run

    def _lane(self) -> None:
        """On a write thread: one run, then this lane again at the back of the pool's queue."""
        while run := self._take():
            try:
                results = self._write(run)
            except BaseException as bug:  # reported on the loop, never lost in a future
                results = [(None, bug)] * len(run)
            for pending, (checksum, exc) in zip(run, results, strict=True):
                pending.done.post(self._on_done, pending, checksum, exc)
            if self.closed:
                continue  # the pool is shutting down: report the rest unwritten here
            try:
                self._pool.submit(self._lane)
                return
            except RuntimeError:  # shut down meanwhile
                continue

    def _write(self, run: list[PendingWrite]) -> list[tuple[int | None, BaseException | None]]:
        """The run's pre-writes, then its live blocks' slots (one ``pwritev`` per stretch
        of adjacent live blocks: one, unless a block was dropped); per block, its checksum
        or the error."""
        if self.closed:
            return [(None, None)] * len(run)
        live = [not p.res.entry.dropped for p in run]  # a flag the loop may set: a hint
        checksums: list[int | None] = [None] * len(run)
        for i, p in enumerate(run):
            if live[i]:
                checksums[i] = self._header(p)
        results: list[tuple[int | None, BaseException | None]] = [(None, None)] * len(run)
        file, local = self._file, self._local
        with self._slots:
            try:
                for p in run:
                    res = p.res
                    if res.region_header is not None:
                        offset, header = res.region_header
                        local.page[:] = header.pack()
                        file.write([local.page], offset)
                    if res.invalidate:
                        file.zero_page(res.offset, local.zero)
            except BaseException as exc:
                return [(None, exc)] * len(run)
            for i, j in _stretches(live):
                slots = [memoryview(p.buf)[: p.res.slot_bytes] for p in run[i:j]]
                try:
                    file.write(slots, run[i].res.offset)
                except BaseException as exc:
                    results[i:] = [(None, exc)] * (len(run) - i)
                    break
                results[i:j] = [(c, None) for c in checksums[i:j]]
        return results

    def _header(self, p: PendingWrite) -> int:
        """The block's checksum (computed when the writer sent none), its header packed
        into its buffer's first page; off the I/O slot."""
        mv = memoryview(p.buf)
        checksum = p.checksum
        if checksum == NOT_COMPUTED:
            checksum = block_checksum(mv[PAGE : PAGE + p.length])
        res = p.res
        k = res.entry.key
        name = self._scope_names.get(k[1], b"")
        mv[:PAGE] = SlotHeader(
            res.slot_bytes, res.epoch, k[0], k[1], k[2], p.length, checksum, res.seq, name
        ).pack()
        return checksum
