"""DiskTier: the disk tier's storage engine (issue #33), as the node sees it.

One preallocated file of fixed-size slots (layout: `service.disk.format`;
space and eviction: `service.disk.index`). The file is sized once to fit
the cap and never grown, so the bytes on disk never exceed it.

- **Writes are behind and bounded.** `offer` copies the block into a
  page-aligned buffer (`reserve_write` lends it to a caller that copies off
  the loop), reserves a slot and hands the write to an I/O thread; a full
  queue, a degraded tier or no slot to be had is a refusal, counted, never a
  wait. The block becomes visible (`run_length`, `read_into`) only once its
  write completed. A write that
  fails (ENOSPC, EIO) leaves no entry and degrades the tier: one log line, a
  flag and a counter; reads go on.
- **Reads are checked.** `read_into` (`read_many` for a chain; scheduled by
  `service.disk.reads`) reads the header page and the payload (straight into
  the caller's buffer when it is page-aligned and whole pages, else through a
  bounce buffer) off the loop, then checks that the header names the block
  and the payload has its checksum; a mismatch discards the slot and is a
  miss, counted.
- **Crash safety.** A reused slot's header is zeroed before the new block
  goes in; header and payload checksums catch any torn write; removed
  blocks' headers are zeroed before their slot is free (a restart never
  brings back what was dropped, barring a crash in between). A clean
  `close` leaves a checkpoint of the index (`service.disk.checkpoint`); the
  open after a crash scans the slot headers (`service.disk.rebuild`).

Threads: every method but `open` runs on the event loop's thread, which
alone touches the index; the I/O threads see only the offsets, buffers and
expected headers they are given (`service.disk.jobs`), and report back
through one `Completions` channel.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from service.disk.checkpoint import write_checkpoint
from service.disk.entry import Key
from service.disk.format import DiskKey, SlotHeader, Superblock
from service.disk.in_flight import InFlight
from service.disk.index import DiskIndex
from service.disk.io import DiskTierError, TierFile, open_tier_file
from service.disk.jobs import (
    Completions,
    PendingWrite,
    ReadBatch,
    ReadResult,
    ThreadBuffers,
    WriteBuffers,
)
from service.disk.reads import VERIFY_THREADS, SlotRead, SlotReader, count_read
from service.disk.rebuild import rebuild_index
from service.disk.stats import TIER_COUNTERS, DiskEvent, DiskEventKind, DiskEvents, DiskStats
from service.disk.writes import WriteLanes

__all__ = ["DiskEvent", "DiskEventKind", "DiskKey", "DiskStats", "DiskTier", "DiskTierError"]

log = logging.getLogger(__name__)


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
        # io_threads I/Os in flight in all (the semaphore): writes in their own pool (adjacent
        # slots in one pwritev, `service.disk.writes`), reads with VERIFY_THREADS more
        # threads, so that a read's check runs while the next read holds the I/O slot it freed.
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-disk")
        self._read_pool = ThreadPoolExecutor(
            io_threads + VERIFY_THREADS, thread_name_prefix="kvstore-disk-read"
        )
        self._io_slots = threading.Semaphore(io_threads)
        self._local = ThreadBuffers()
        self._reader = SlotReader(file, self._read_pool, io_threads, self._io_slots, self._local)
        self._done: Completions | None = None
        # As many as the queue holds: a fresh buffer faults a page per 4 KiB on first use.
        self._buffers = WriteBuffers(keep=queue_blocks)
        self.events = DiskEvents()
        """Blocks stored and removed (`take_events`; a listener may be told of each)."""
        self.scope_names: dict[int, bytes] = {}
        """Tenant scope names by their u64 digest (`DiskKey.scope_name`), from offers and
        the file: what a restarted node names a block's scope with."""
        self._writes = WriteLanes(
            file,
            self._pool,
            io_threads,
            self._io_slots,
            self._local,
            self.scope_names,
            self._write_done,
        )
        self._queued = 0
        self._in_flight = InFlight()  # writes + invalidations
        self._closed = False
        self._degraded = False
        self._c: dict[str, int] = dict.fromkeys(TIER_COUNTERS, 0)
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

        The index comes from a clean stop's checkpoint, else from the slot
        headers (torn or corrupt ones discarded and counted). Blocking: call it off the loop
        (``asyncio.to_thread``) or before the loop starts.

        Args:
            path: the tier file (its folder must exist).
            capacity_bytes: the cap: the file is preallocated once to at most this.
            queue_blocks: bound of the write-behind queue (blocks).
            io_threads: reads and writes in flight at once.
            direct: O_DIRECT (page cache bypassed); False only for file
                systems without it (ramfs; tmpfs has it since Linux 6.6).
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
        self.scope_names.update(done.scopes)
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
        view = memoryview(data).cast("B")
        pending = self.reserve_write(key, view.nbytes, checksum)
        if pending is None:
            return False
        # numpy's copy lets go of the GIL (a memoryview's does not): I/O goes on meanwhile.
        np.copyto(np.frombuffer(pending.payload, np.uint8), np.frombuffer(view, np.uint8))
        self.submit_write(pending)
        return True

    def reserve_write(self, key: DiskKey, length: int, checksum: int) -> PendingWrite | None:
        """`offer` in two steps, for a caller that copies the block itself (off the loop):
        a slot and a page-aligned buffer (``payload``: ``length`` bytes to fill, from any
        thread), then `submit_write` or `cancel_write`, on the loop. Refused (None,
        counted) as `offer` is; a reservation takes a place in the queue until then."""
        done = self._completions()
        k: Key = (key.namespace, key.scope, key.block_hash)
        if k in self._index:
            self._c["write_present"] += 1
            return None
        if self._closed or self._degraded or self._queued >= self._queue_blocks:
            self._c["write_drops"] += 1
            return None
        self.scope_names.setdefault(key.scope, key.scope_name)
        res = self._index.reserve(k, length, checksum)
        if res is None:
            self._c["write_drops"] += 1
            return None
        buf = self._buffers.take(res.slot_bytes)
        self._queued += 1
        self._in_flight.begin()
        return PendingWrite(done, res, buf, length, checksum)

    def submit_write(self, pending: PendingWrite) -> None:
        """Hand a reserved block, its payload filled, to the write lanes; on the loop."""
        assert not pending.handed, "bug: a pending write handed twice"
        pending.handed = True
        if self._closed:  # the pool is gone: as if it had been dropped
            self._write_done(pending, None, None)
            return
        self._writes.put(pending)
        self._collect()

    def cancel_write(self, pending: PendingWrite) -> None:
        """Give a reservation back unwritten (its copy was torn); on the loop."""
        assert not pending.handed, "bug: a pending write handed twice"
        pending.handed = True
        self._write_done(pending, None, None)

    def _write_done(
        self, pending: PendingWrite, checksum: int | None, exc: BaseException | None
    ) -> None:
        """On the loop, per block: written (its checksum), or not (None; ``exc`` failed it)."""
        self._queued -= 1
        res = pending.res
        self._buffers.give_back(res.slot_bytes, pending.buf)
        e = res.entry
        if checksum is None:
            self._index.write_failed(e)
            if exc is not None:
                self._write_error(exc)
        else:
            e.checksum = checksum
            if self._index.committed(e):
                self._c["writes"] += 1
                self._c["write_bytes"] += pending.length
                self.events.add(DiskEventKind.STORED, DiskKey(*e.key))
        self._collect()
        self._in_flight.end()

    def _write_error(self, exc: BaseException) -> None:
        self._c["write_errors"] += 1
        if not isinstance(exc, OSError):
            log.error("disk tier: bug in a write", exc_info=exc)
        is_enospc = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
        self._c["enospc"] += is_enospc
        if not self._degraded:
            self._degraded = True
            log.error(
                "disk tier degraded: a write failed (%s); it takes no more blocks, "
                "the memory tier goes on",
                exc,
            )

    # -- reads ---------------------------------------------------------------

    def run_length(self, namespace: bytes, scope: int, hashes: Sequence[bytes]) -> int:
        """How many leading hashes of the chain are on disk (index only, no I/O)."""
        return self._index.run_length(namespace, scope, hashes)

    def length_of(self, key: DiskKey) -> int | None:
        """The payload length of a block on disk, or None when it is not there."""
        e = self._index.ready((key.namespace, key.scope, key.block_hash))
        return None if e is None else e.length

    def checksum_of(self, key: DiskKey) -> int | None:
        """The payload checksum of a block on disk (what its reads are verified
        against), or None when it is not there."""
        e = self._index.ready((key.namespace, key.scope, key.block_hash))
        return None if e is None else e.checksum

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
        return (await self.read_many([key], [dest]))[0] is ReadResult.OK

    async def read_many(
        self, keys: Sequence[DiskKey], dests: Sequence[memoryview]
    ) -> list[ReadResult | None]:
        """`read_into` for many blocks at once (a chain's promotion): all are
        handed to the I/O threads together, and the loop wakes once when the
        last has landed. Returns each block's verdict: `ReadResult.OK` when
        ``dests[i]`` holds it; IDENTITY or CHECKSUM when its bytes on disk were
        corrupt, ERROR when the read failed (each discarded and counted); None
        when it was not on disk (or the tier is closed). A caller running
        beside others learns its own blocks' verdicts, never a tier-wide count.

        Raises:
            ValueError: a destination is not its block's length or not writable
                (nothing is read).
        """
        if len(keys) != len(dests):
            raise ValueError(f"read_many: {len(keys)} keys, {len(dests)} destinations")
        if self._closed:
            return [None] * len(keys)
        index = self._index
        entries = [index.begin_read((k.namespace, k.scope, k.block_hash)) for k in keys]
        for e, dest in zip(entries, dests, strict=True):
            if e is not None and (dest.nbytes != e.length or dest.readonly):
                for held in entries:
                    if held is not None:
                        index.end_read(held, touch=False, discard=False)
                raise ValueError(
                    f"read_into needs a writable buffer of {e.length} bytes, not {dest.nbytes}"
                )
        done = self._completions()
        loop = asyncio.get_running_loop()
        batch = ReadBatch(
            [None] * len(keys), sum(e is not None for e in entries), loop.create_future()
        )
        try:
            reads: list[SlotRead] = []
            for i, e in enumerate(entries):
                if e is not None:
                    r = index.region(e.region)
                    name = self.scope_names.get(e.key[1], b"")
                    want = SlotHeader(
                        r.slot_bytes, r.epoch, *e.key, e.length, e.checksum, e.seq, name
                    )
                    reads.append(SlotRead.of(i, want, index.offset_of(e), dests[i]))
            if reads:
                self._reader.submit(done, batch, reads)
            if batch.left:
                try:
                    await asyncio.shield(batch.done)
                except asyncio.CancelledError:
                    await batch.done  # the threads may still be writing into dests
                    raise
        finally:
            # Not landed (cancelled before its submit): released as it was.
            for e, result in zip(entries, batch.results, strict=True):
                if e is not None:
                    index.end_read(
                        e,
                        touch=result is ReadResult.OK,
                        discard=result not in (None, ReadResult.OK),
                    )
            self._collect()
        verdicts = batch.results
        for e, verdict in zip(entries, verdicts, strict=True):
            count_read(self._c, e, verdict)
        return [v if e is not None else None for e, v in zip(entries, verdicts, strict=True)]

    # -- removal, events, figures ----------------------------------------------

    def drop_namespace(self, namespace: bytes) -> int:
        """Forget every block of a namespace (their headers are invalidated
        behind); returns how many."""
        self._completions()
        n = self._index.drop_namespace(namespace)
        self._collect()
        return n

    def keys_of(self, namespace: bytes) -> list[Key]:
        """The keys of a namespace's blocks on disk (index only)."""
        return self._index.ready_keys(namespace)

    def take_events(self) -> list[DiskEvent]:
        """The blocks stored and removed since the last call, in order."""
        return self.events.take()

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

    def _completions(self) -> Completions:
        """The channel from the I/O threads to the running loop (bound on first use)."""
        if self._done is None:
            self._done = Completions(asyncio.get_running_loop())
        return self._done

    def _collect(self) -> None:
        """Side effects the index left: removal events, header pages to zero."""
        for k in self._index.take_removed():
            self.events.add(DiskEventKind.REMOVED, DiskKey(*k))
        jobs = self._index.take_invalidations()
        if not jobs or self._done is None or self._closed:
            return  # closed: they stay in limbo, zeroed at the next open
        self._in_flight.begin()
        self._pool.submit(self._invalidate_task, self._done, jobs)

    def _invalidate_task(self, done: Completions, jobs: list[tuple[int, int, int]]) -> None:
        """On an I/O thread: zero the header pages of slots in limbo."""
        exc: BaseException | None = None
        try:
            if self._closed:
                raise OSError(errno.ECANCELED, "the tier is closing")
            for offset, _, _ in jobs:
                with self._io_slots:
                    self._file.zero_page(offset, self._local.zero)
        except BaseException as e:
            exc = e
        done.post(self._invalidated, jobs, exc)

    def _invalidated(self, jobs: list[tuple[int, int, int]], exc: BaseException | None) -> None:
        if exc is None:
            for _, region, slot in jobs:
                self._index.invalidated(region, slot)
        elif not (isinstance(exc, OSError) and exc.errno == errno.ECANCELED):
            self._write_error(exc)  # those slots stay in limbo: never reused
        self._in_flight.end()

    # -- stop ----------------------------------------------------------------

    async def flush(self, timeout: float) -> bool:  # noqa: ASYNC109 (a bool, not a raise)
        """Wait until the queued writes have completed; False if ``timeout`` ran out."""
        return await self._in_flight.wait_idle(timeout)

    async def close(self, *, checkpoint: bool = True) -> None:
        """Stop: queued writes not yet started are dropped (call `flush` first
        for a clean stop), the ones in flight complete, the index is saved as
        a checkpoint (unless the tier is degraded, or ``checkpoint`` is False:
        the next open then scans the headers, as after a crash), the file is
        closed."""
        if self._closed:
            return
        self._closed = self._writes.closed = True
        await asyncio.to_thread(self._pool.shutdown, wait=True)  # queued writes skip their I/O
        await asyncio.to_thread(self._read_pool.shutdown, wait=True)
        await asyncio.sleep(0)  # the done callbacks of the last jobs
        try:
            if checkpoint and not self._degraded:
                snap = self._index.snapshot()  # on the loop: the index is the loop's
                await asyncio.to_thread(
                    write_checkpoint, self._file, self._sb, snap, self.scope_names
                )
        except OSError as exc:
            log.warning(
                "disk tier: no checkpoint written (%s): the next start scans the headers", exc
            )
        finally:
            self._file.close()
