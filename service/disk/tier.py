"""DiskTier: the disk tier's storage engine (issue #33), as the node sees it.

Interface first; the design (file layout, eviction) is written in
`service.disk.format` and `service.disk.index` as they land.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum


class DiskTierError(OSError):
    """The tier cannot start: one line naming the setting, the path and the fix."""


@dataclass(frozen=True, slots=True)
class DiskKey:
    """A block's identity on disk."""

    namespace: bytes
    """16-byte stable digest of the namespace's identity (name + layout), the caller's."""
    scope: int
    """The tenant scope the block belongs to (u64): same hash, other scope = other block."""
    block_hash: int
    """The chained prefix hash (u64)."""


class DiskEventKind(Enum):
    """What happened to a block on disk."""

    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class DiskEvent:
    """A block that reached the disk (its write completed) or left it (evicted,
    dropped, discarded). Taken by `DiskTier.take_events`, for KV events and the
    Redis directory (medium "disk")."""

    kind: DiskEventKind
    key: DiskKey


@dataclass(frozen=True, slots=True)
class DiskStats:
    """A snapshot of the tier, for /metrics, the CLI and the web page."""

    capacity_bytes: int
    """The configured cap; the file's size never exceeds it."""
    file_bytes: int
    """The preallocated file's size (≤ capacity_bytes)."""
    used_bytes: int
    """Bytes of slots holding a block (header page + payload rounded to 4 KiB)."""
    blocks: int
    """Blocks on disk (readable)."""
    blocks_by_namespace: dict[bytes, int] = field(default_factory=dict)
    """Blocks per namespace digest."""
    writes: int = 0
    """Blocks written (their write completed)."""
    write_bytes: int = 0
    """Payload bytes written."""
    write_drops: int = 0
    """Offers refused: the queue was full, the tier degraded, or no slot was free."""
    write_present: int = 0
    """Offers refused because the block was already on disk (or being written)."""
    write_errors: int = 0
    """Writes that failed (EIO, ENOSPC): no index entry was left."""
    enospc: int = 0
    """Of write_errors, those that were ENOSPC."""
    evictions: int = 0
    """Blocks evicted to make room (LRU)."""
    reads: int = 0
    """Blocks read back and verified."""
    read_bytes: int = 0
    """Payload bytes read back and verified."""
    read_failures_checksum: int = 0
    """Reads whose payload checksum did not match: the slot was discarded."""
    read_failures_identity: int = 0
    """Reads whose header did not name the block (torn, overwritten): discarded."""
    read_errors: int = 0
    """Reads that failed with an OS error (EIO): a miss."""
    discarded_at_open: int = 0
    """Slot headers found torn or corrupt when the index was rebuilt."""
    rebuilt_blocks: int = 0
    """Blocks the index found on disk when the tier opened."""
    rebuild_seconds: float = 0.0
    """How long the rebuild took."""
    degraded: bool = False
    """A write failed with ENOSPC or EIO: the tier takes no more writes."""
    queue_depth: int = 0
    """Writes queued or in flight."""
    queue_blocks: int = 0
    """The queue's bound."""


class DiskTier:
    """One preallocated file of fixed-size slots: write-behind, verified reads.

    The index is touched only from the event loop's thread (every method but
    `open` is called there); the I/O threads only read and write slots the
    index reserved for them.
    """

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

        Raises:
            DiskTierError: missing folder, unwritable, no O_DIRECT on that file
                system, capacity too small or more than the free space; one line.
        """
        raise NotImplementedError

    def offer(self, key: DiskKey, data: bytes | memoryview, checksum: int) -> bool:
        """Queue a block to be written behind; never blocks on I/O.

        ``data`` is copied before this returns. ``checksum`` is the block's
        xxh3-64 (`kvstore.checksum`), 0 when not computed (the tier computes it).
        Returns False (and counts it) when the queue is full, the tier is
        degraded, no slot can be had, or the block is already on disk or queued.
        Must be called on the event loop's thread (a running loop).
        """
        raise NotImplementedError

    def run_length(self, namespace: bytes, scope: int, hashes: Sequence[int]) -> int:
        """How many leading hashes of the chain are on disk (index only, no I/O)."""
        raise NotImplementedError

    def length_of(self, key: DiskKey) -> int | None:
        """The payload length of a block on disk, or None when it is not there."""
        raise NotImplementedError

    async def read_into(self, key: DiskKey, dest: memoryview) -> bool:
        """Read a block into ``dest`` (its length must be the block's) off the loop.

        The header's identity and the payload's checksum are verified after
        the read; a mismatch discards the slot, counts it and returns False,
        as does a block that is not on disk. Page-aligned ``dest`` of a
        4 KiB-multiple length is read into directly, else through a bounce
        buffer. On success the block becomes the most recently used.
        """
        raise NotImplementedError

    def drop_namespace(self, namespace: bytes) -> int:
        """Forget every block of a namespace (their headers are invalidated
        behind); returns how many."""
        raise NotImplementedError

    def take_events(self) -> list[DiskEvent]:
        """The blocks stored and removed since the last call, in order."""
        raise NotImplementedError

    def stats(self) -> DiskStats:
        """A snapshot of the counters and occupancy."""
        raise NotImplementedError

    async def flush(self, timeout: float) -> bool:  # noqa: ASYNC109 (a bool, not a raise)
        """Wait until the queued writes have completed; False if ``timeout`` ran out."""
        raise NotImplementedError

    async def close(self) -> None:
        """Stop: queued writes not yet started are dropped (call `flush` first
        for a clean stop), the ones in flight complete, the file is closed."""
        raise NotImplementedError
