"""The disk tier's figures and events, as data the node reads (`DiskTier.stats`,
`DiskTier.take_events`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from service.disk.format import DiskKey


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


class DiskEvents:
    """The tier's stored and removed blocks, kept until taken (`DiskTier.take_events`).

    ``listener`` (the node's, `service.disk.node_tier`) is called after each
    event is added, on the loop: it schedules the events' publication.
    """

    __slots__ = ("_events", "listener")

    def __init__(self) -> None:
        self._events: list[DiskEvent] = []
        self.listener: Callable[[], None] | None = None

    def add(self, kind: DiskEventKind, key: DiskKey) -> None:
        self._events.append(DiskEvent(kind, key))
        if self.listener is not None:
            self.listener()

    def take(self) -> list[DiskEvent]:
        out, self._events = self._events, []
        return out


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
    opened_from: str = "new"
    """Where the index came from: "new" (a new file), "checkpoint" (a clean stop's),
    "headers" (a scan of the slot headers: the last stop was not clean)."""
    degraded: bool = False
    """A write failed with ENOSPC or EIO: the tier takes no more writes."""
    queue_depth: int = 0
    """Writes queued or in flight."""
    queue_blocks: int = 0
    """The queue's bound."""


TIER_COUNTERS = (
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
