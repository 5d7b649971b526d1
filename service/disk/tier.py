"""DiskTier: the disk tier's storage engine (issue #33), as the node sees it.

One preallocated file of fixed-size slots (layout: `service.disk.format`;
space and eviction: `service.disk.index`). The file is sized once to fit
the cap and never grown, so the bytes on disk never exceed it.

- **Writes are behind and bounded.** `offer` copies the block into a
  page-aligned buffer, reserves a slot and hands the write to one of
  ``io_threads`` threads; a full queue, a degraded tier or no slot to be
  had is a refusal, counted, never a wait. The block becomes visible
  (`run_length`, `read_into`) only once its write completed. A write that
  fails (ENOSPC, EIO) leaves no entry and degrades the tier: one log line, a
  flag and a counter; reads go on.
- **Reads are checked.** `read_into` reads the header page and the payload
  (straight into the caller's buffer when it is page-aligned and whole pages,
  else through a bounce buffer) off the loop, then checks that the header
  names the block and the payload has its checksum; a mismatch discards the
  slot and is a miss, counted.
- **Crash safety.** A reused slot's header is zeroed before the new block
  goes in; header and payload checksums catch any torn write; removed
  blocks' headers are zeroed before their slot is free (a restart never
  brings back what was dropped, barring a crash in between).

Threads: every method but `open` runs on the event loop's thread, which
alone touches the index; the I/O threads see only the offsets and buffers
they are given, and report back with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvstore.checksum import NOT_COMPUTED, block_checksum
from service.disk.checkpoint import write_checkpoint
from service.disk.entry import Entry, Key
from service.disk.format import PAGE, DiskKey, SlotHeader, Superblock, round_up
from service.disk.index import DiskIndex, Reservation
from service.disk.io import DiskTierError, TierFile, address_of, aligned, open_tier_file
from service.disk.rebuild import rebuild_index
from service.disk.stats import DiskEvent, DiskEventKind, DiskStats

__all__ = ["DiskEvent", "DiskEventKind", "DiskKey", "DiskStats", "DiskTier", "DiskTierError"]

log = logging.getLogger(__name__)

_READ_OK, _READ_IDENTITY, _READ_CHECKSUM, _READ_ERROR = 0, 1, 2, 3
_COUNTERS = (
    "writes",
    "write_bytes",
    "write_drops",
    "write_present",
    "write_errors",
    "enospc",
    "reads",
    "read_bytes",
    "read_failures_checksum",
    "read_failures_identity",
    "read_errors",
    "discarded_at_open",
    "rebuilt_blocks",
)
"""The counters of `DiskStats` the tier keeps itself (the index keeps the rest)."""
_FAILURE_COUNTER = {
    _READ_IDENTITY: "read_failures_identity",
    _READ_CHECKSUM: "read_failures_checksum",
    _READ_ERROR: "read_errors",
}


class _ThreadBuffers(threading.local):
    """Each I/O thread's header page and bounce buffer, reused across calls."""

    def __init__(self) -> None:
        self.page = aligned(PAGE)
        self.zero = aligned(PAGE)
        self.bounce = aligned(PAGE)

    def bounce_of(self, nbytes: int) -> Any:
        if len(self.bounce) < nbytes:
            self.bounce.close()
            self.bounce = aligned(nbytes)
        return self.bounce


class DiskTier:
    """One preallocated file of fixed-size slots: write-behind, verified reads."""

    def __init__(
        self,
        file: TierFile,
        index: DiskIndex,
        capacity_bytes: int,
        queue_blocks: int,
        io_threads: int,
    ) -> None:
        self._file = file
        self._index = index
        self._capacity = capacity_bytes
        self._queue_blocks = queue_blocks
        self._io_threads = io_threads
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-disk")
        self._local = _ThreadBuffers()
        self._buffers: dict[int, list[Any]] = {}
        self._events: list[DiskEvent] = []
        self._queued = 0
        self._in_flight = 0  # writes + invalidations
        self._idle: asyncio.Event | None = None
        self._closed = False
        self._degraded = False
        self._c: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._rebuild_seconds = 0.0
        self._opened_from = "new"
        self._sb = Superblock(index.region_bytes, 0)

    @classmethod
    def open(
        cls,
        path: str,
        capacity_bytes: int,
        *,
        queue_blocks: int = 256,
        io_threads: int = 4,
        direct: bool = True,
        region_bytes: int = 64 << 20,
        wrap: Callable[[TierFile], TierFile] | None = None,
    ) -> DiskTier:
        """Create and preallocate, or reopen, the tier file at ``path``.

        The index is rebuilt from the slot headers (torn or corrupt ones are
        discarded and counted). Blocking: call it off the loop
        (``asyncio.to_thread``) or before the loop starts.

        Args:
            path: the tier file (its folder must exist).
            capacity_bytes: the cap: the file is preallocated once to at most this.
            queue_blocks: bound of the write-behind queue (blocks).
            io_threads: reads and writes in flight at once.
            direct: O_DIRECT (page cache bypassed); False only for file
                systems without it (tmpfs), when chosen explicitly.
            region_bytes: the unit a slot size is given space in (tests use
                small ones); a reopened file keeps its own.
            wrap: the I/O seam: given the opened file, returns the one the
                tier uses (tests fail its writes with ENOSPC or EIO).

        Raises:
            DiskTierError: missing folder, unwritable, no O_DIRECT on that file
                system, capacity too small or more than the free space; one line.
        """
        if queue_blocks < 1 or io_threads < 1:
            raise ValueError("queue_blocks and io_threads must be at least 1")
        file, sb, reopened = open_tier_file(path, capacity_bytes, direct, region_bytes)
        if wrap is not None:
            file = wrap(file)
        try:
            index = DiskIndex(sb.regions, sb.region_bytes)
            tier = cls(file, index, capacity_bytes, queue_blocks, io_threads)
            tier._sb = sb
            if reopened:
                tier._rebuild(path, sb)
            return tier
        except BaseException:
            file.close()
            raise

    def _rebuild(self, path: str, sb: Superblock) -> None:
        """The index from the checkpoint of a clean stop, else from the slot headers."""
        done = rebuild_index(self._file, sb, self._index, self._io_threads, self._local.zero)
        self._sb = done.superblock
        self._opened_from = done.source
        self._rebuild_seconds = done.seconds
        self._c["discarded_at_open"] = done.discarded
        self._c["rebuilt_blocks"] = self._index.ready_blocks
        log.info(
            "disk tier %s: %d blocks from the %s in %.2f s, %d headers discarded",
            path,
            self._index.ready_blocks,
            done.source,
            done.seconds,
            done.discarded,
        )

    # -- writes --------------------------------------------------------------

    def offer(self, key: DiskKey, data: bytes | memoryview, checksum: int) -> bool:
        """Queue a block to be written behind; never blocks on I/O.

        ``data`` is copied before this returns. ``checksum`` is the block's
        xxh3-64 (`kvstore.checksum`), 0 when not computed (the tier computes it).
        Returns False (and counts it) when the queue is full, the tier is
        degraded, no slot can be had, or the block is already on disk or queued.
        Must be called on the event loop's thread (a running loop).
        """
        loop = asyncio.get_running_loop()
        k: Key = (key.namespace, key.scope, key.block_hash)
        if k in self._index:
            self._c["write_present"] += 1
            return False
        if self._closed or self._degraded or self._queued >= self._queue_blocks:
            self._c["write_drops"] += 1
            return False
        view = memoryview(data).cast("B")
        res = self._index.reserve(k, view.nbytes, checksum)
        if res is None:
            self._c["write_drops"] += 1
            return False
        buf = self._buffer(res.slot_bytes)
        memoryview(buf)[PAGE : PAGE + view.nbytes] = view
        self._queued += 1
        self._begin()
        fut = self._pool.submit(self._write_job, res, buf, view.nbytes, checksum)
        fut.add_done_callback(
            lambda f: loop.call_soon_threadsafe(self._write_done, res, buf, view.nbytes, f)
        )
        self._collect(loop)
        return True

    def _write_job(self, res: Reservation, buf: Any, length: int, checksum: int) -> int:
        """On an I/O thread: header into the buffer's first page, then the writes."""
        mv = memoryview(buf)
        if checksum == NOT_COMPUTED:
            checksum = block_checksum(mv[PAGE : PAGE + length])
        k = res.entry.key
        mv[:PAGE] = SlotHeader(
            res.slot_bytes, res.epoch, k[0], k[1], k[2], length, checksum, res.seq
        ).pack()
        local = self._local
        if res.region_header is not None:
            offset, header = res.region_header
            local.page[:] = header.pack()
            self._file.write([local.page], offset)
        if res.invalidate:
            self._file.zero_page(res.offset, local.zero)
        self._file.write([mv[: res.slot_bytes]], res.offset)
        return checksum

    def _write_done(self, res: Reservation, buf: Any, length: int, fut: Future[int]) -> None:
        self._queued -= 1
        self._give_back(res.slot_bytes, buf)
        e = res.entry
        exc = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or exc is not None:
            self._index.write_failed(e)
            if exc is not None:
                self._write_error(exc)
        else:
            e.checksum = fut.result()
            if self._index.committed(e):
                self._c["writes"] += 1
                self._c["write_bytes"] += length
                self._events.append(DiskEvent(DiskEventKind.STORED, DiskKey(*e.key)))
        self._collect(asyncio.get_running_loop())
        self._end()

    def _write_error(self, exc: BaseException) -> None:
        self._c["write_errors"] += 1
        is_enospc = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
        self._c["enospc"] += is_enospc
        if not self._degraded:
            self._degraded = True
            log.error(
                "disk tier degraded: a write failed (%s); it takes no more blocks, "
                "the memory tier goes on",
                exc,
            )

    def _buffer(self, slot_bytes: int) -> Any:
        free = self._buffers.get(slot_bytes)
        return free.pop() if free else aligned(slot_bytes)

    def _give_back(self, slot_bytes: int, buf: Any) -> None:
        free = self._buffers.setdefault(slot_bytes, [])
        if len(free) < self._io_threads + 4:
            free.append(buf)
        else:
            buf.close()

    # -- reads ---------------------------------------------------------------

    def run_length(self, namespace: bytes, scope: int, hashes: Sequence[int]) -> int:
        """How many leading hashes of the chain are on disk (index only, no I/O)."""
        return self._index.run_length(namespace, scope, hashes)

    def length_of(self, key: DiskKey) -> int | None:
        """The payload length of a block on disk, or None when it is not there."""
        e = self._index.ready((key.namespace, key.scope, key.block_hash))
        return None if e is None else e.length

    async def read_into(self, key: DiskKey, dest: memoryview) -> bool:
        """Read a block into ``dest`` (its length must be the block's) off the loop.

        The header's identity and the payload's checksum are verified after
        the read; a mismatch discards the slot, counts it and returns False,
        as does a block that is not on disk. Page-aligned ``dest`` of a
        4 KiB-multiple length is read into directly, else through a bounce
        buffer. On success the block becomes the most recently used.
        Cancelled, it still waits for its read to land (never a late write
        into ``dest``).

        Raises:
            ValueError: ``dest`` is not the block's length or not writable.
        """
        e = self._index.begin_read((key.namespace, key.scope, key.block_hash))
        if e is None:
            return False
        if dest.nbytes != e.length or dest.readonly:
            self._index.end_read(e, touch=False, discard=False)
            raise ValueError(
                f"read_into needs a writable buffer of {e.length} bytes, not {dest.nbytes}"
            )
        result: int | None = None
        try:
            loop = asyncio.get_running_loop()
            epoch = self._index.region(e.region).epoch
            fut = loop.run_in_executor(
                self._pool, self._read_job, e, self._index.offset_of(e), epoch, dest
            )
            try:
                result = await asyncio.shield(fut)
            except asyncio.CancelledError:
                await asyncio.wait([fut])  # the thread may still be writing into dest
                raise
        except OSError as exc:
            result = _READ_ERROR
            log.warning("disk tier: reading block %s failed (%s): discarded", DiskKey(*e.key), exc)
        finally:
            # Cancelled (result None): released as it was, neither touched nor discarded.
            self._index.end_read(
                e, touch=result == _READ_OK, discard=result not in (None, _READ_OK)
            )
            self._collect(asyncio.get_running_loop())
        if result == _READ_OK:
            self._c["reads"] += 1
            self._c["read_bytes"] += e.length
            return True
        self._c[_FAILURE_COUNTER[result]] += 1
        if result != _READ_ERROR:
            log.warning(
                "disk tier: block %s discarded (%s)", DiskKey(*e.key), _FAILURE_COUNTER[result]
            )
        return False

    def _read_job(self, e: Entry, offset: int, epoch: int, dest: memoryview) -> int:
        """On an I/O thread: header page and payload, then both checks."""
        local = self._local
        length = e.length
        padded = round_up(length) if length else PAGE
        dest = dest.cast("B")
        direct = length % PAGE == 0 and length > 0 and address_of(dest) % PAGE == 0
        if direct:
            got = self._file.read_into([local.page, dest], offset)
            payload: Any = dest
        else:
            bounce = memoryview(local.bounce_of(padded))[:padded]
            got = self._file.read_into([local.page, bounce], offset)
            payload = bounce[:length]
        if got < PAGE + length:
            return _READ_IDENTITY
        h = SlotHeader.parse(local.page)
        if h is None or (h.namespace, h.scope, h.block_hash) != e.key or h.seq != e.seq:
            return _READ_IDENTITY
        if h.length != length or h.epoch != epoch or h.checksum != e.checksum:
            return _READ_IDENTITY
        if block_checksum(payload) != e.checksum:
            return _READ_CHECKSUM
        if not direct:
            dest[:] = payload
        return _READ_OK

    # -- removal, events, figures ----------------------------------------------

    def drop_namespace(self, namespace: bytes) -> int:
        """Forget every block of a namespace (their headers are invalidated
        behind); returns how many."""
        n = self._index.drop_namespace(namespace)
        self._collect(asyncio.get_running_loop())
        return n

    def take_events(self) -> list[DiskEvent]:
        """The blocks stored and removed since the last call, in order."""
        out, self._events = self._events, []
        return out

    def stats(self) -> DiskStats:
        """A snapshot of the counters and occupancy."""
        index = self._index
        return DiskStats(
            capacity_bytes=self._capacity,
            file_bytes=self._file.size,
            used_bytes=index.used_bytes,
            blocks=index.ready_blocks,
            blocks_by_namespace=index.per_namespace(),
            evictions=index.evictions,
            rebuild_seconds=self._rebuild_seconds,
            opened_from=self._opened_from,
            degraded=self._degraded,
            queue_depth=self._queued,
            queue_blocks=self._queue_blocks,
            **self._c,
        )

    def _collect(self, loop: asyncio.AbstractEventLoop) -> None:
        """Side effects the index left: removal events, header pages to zero."""
        for k in self._index.take_removed():
            self._events.append(DiskEvent(DiskEventKind.REMOVED, DiskKey(*k)))
        jobs = self._index.take_invalidations()
        if not jobs:
            return
        if self._closed:
            return  # the slots stay in limbo; the file is closing
        self._begin()
        fut = self._pool.submit(self._invalidate_job, jobs)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._invalidated, jobs, f))

    def _invalidate_job(self, jobs: list[tuple[int, int, int]]) -> None:
        zero = self._local.zero
        for offset, _, _ in jobs:
            self._file.zero_page(offset, zero)

    def _invalidated(self, jobs: list[tuple[int, int, int]], fut: Future[None]) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None or fut.cancelled():
            if exc is not None:
                self._write_error(exc)  # those slots stay in limbo: never reused
        else:
            for _, region, slot in jobs:
                self._index.invalidated(region, slot)
        self._end()

    def _begin(self) -> None:
        self._in_flight += 1
        if self._idle is not None:
            self._idle.clear()

    def _end(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0 and self._idle is not None:
            self._idle.set()

    # -- stop ----------------------------------------------------------------

    async def flush(self, timeout: float) -> bool:  # noqa: ASYNC109 (a bool, not a raise)
        """Wait until the queued writes have completed; False if ``timeout`` ran out."""
        if self._in_flight == 0:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self, *, checkpoint: bool = True) -> None:
        """Stop: queued writes not yet started are dropped (call `flush` first
        for a clean stop), the ones in flight complete, the index is saved as
        a checkpoint (unless the tier is degraded, or ``checkpoint`` is False:
        the next open then scans the headers, as after a crash), the file is
        closed."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)
        await asyncio.sleep(0)  # the done callbacks of the last jobs
        try:
            if checkpoint and not self._degraded:
                snap = self._index.snapshot()  # on the loop: the index is the loop's
                await asyncio.to_thread(write_checkpoint, self._file, self._sb, snap)
        except OSError as exc:
            log.warning(
                "disk tier: no checkpoint written (%s): the next start scans the headers", exc
            )
        finally:
            self._file.close()
