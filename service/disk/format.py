"""The disk tier's on-disk format: the one module that packs and parses its bytes.

The file (preallocated once, never grown past the cap)::

    [0, 1 MiB)                      superblock page (the rest of the MiB unused,
                                    so regions start 1 MiB-aligned)
    [1 MiB + i * R, ... + R)        region i (R = region_bytes, 64 MiB by default)
    [1 MiB + n * R, end)            the checkpoint area: the index as a clean stop
                                    left it (88 bytes a slot at most: 1.1% of the file,
                                    and 137 KiB of tenant scope names)

A region belongs to one slot size while it holds blocks::

    [0, 4 KiB)                      region header: slot size, region epoch
    [4 KiB + j * S, ... + S)        slot j (S = slot size = 4 KiB header page +
                                    the payload rounded up to 4 KiB)

A slot is its header page followed by the payload, written by one ``pwrite``.
Every header ends with an xxh3-64 of its own bytes (a torn or flipped header
is never believed); a slot header also carries the payload's xxh3-64
(`kvstore.checksum`), checked when the block is read back. A slot header
counts only under a region header with the same slot size and epoch: a
region given to another slot size gets a new epoch, which turns every
header left in it stale with one page written. All integers little-endian.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field

import xxhash

PAGE = 4096
"""O_DIRECT alignment and the unit of slots: every offset and length is a multiple."""

DATA_START = 1 << 20
"""Where region 0 starts: the superblock's page plus padding to 1 MiB."""

VERSION = 2
"""2: a slot keeps its block's full 32-byte hash and its tenant scope's name (1 kept
8 bytes of the hash: too little to name the block to Redis or in KV events). A file
of another version is refused at open with one line (`service.disk.tier`)."""

FILE_MAGIC = b"KVSTDSK\x01"
CHECKPOINT_MAGIC = b"KVSTCKP\x01"
REGION_MAGIC = b"KVSTRGN\x01"
SLOT_MAGIC = b"KVSTSLT\x01"

_SUPER = struct.Struct("<8sIIQQQ")  # magic, version, pad, region_bytes, regions, clean
_CHECKPOINT = struct.Struct("<8sIIQQQQQQQ")
# magic, version, scopes, stamp, entries, limbo, regions, next_seq, next_epoch, and the xxh3-64
# of the records that follow the header page
CHECKPOINT_ENTRY = struct.Struct("<IIQ16sQ32sQQ")
"""A block in the checkpoint: region, slot, seq, namespace, scope, block_hash, length, checksum."""
CHECKPOINT_SLOT = struct.Struct("<II")
"""A slot in limbo (its header still to zero): region, slot."""
CHECKPOINT_SCOPE = struct.Struct("<QB128s")
"""A tenant scope's name: scope (u64 digest), name length, name (up to `SCOPE_NAME_BYTES`)."""
CHECKPOINT_SCOPES = 1024
"""Scope names a checkpoint has room for; a tier with more is rebuilt from headers."""
SCOPE_NAME_BYTES = 128
"""Longest tenant scope name a slot keeps (tenant names are 1-128 characters)."""
CHECKPOINT_REGION = struct.Struct("<IIQ")
"""A region given to a slot size: index, slot_bytes, epoch."""
_REGION = struct.Struct("<8sIIQQ")  # magic, version, slot_bytes, epoch, region index
_SLOT = struct.Struct("<8sIIQ16sQ32sQQQB128s")
# magic, version, slot_bytes, epoch, namespace, scope, block_hash, length, checksum, seq,
# scope name length, scope name
_TAIL = struct.Struct("<Q")  # xxh3-64 of the header's bytes before it
SLOT_HEADER_BYTES = _SLOT.size + _TAIL.size
"""The bytes of a slot header page that count (the rest of the page is zero)."""

Page = bytes | memoryview | mmap.mmap
"""A header page as read: any buffer."""

U64 = (1 << 64) - 1
NAMESPACE_BYTES = 16
HASH_BYTES = 32


@dataclass(frozen=True, slots=True)
class DiskKey:
    """A block's identity on disk: what a slot header names."""

    namespace: bytes
    """16-byte stable digest of the namespace's identity (name + layout), the caller's."""
    scope: int
    """The tenant scope the block belongs to (u64): same hash, other scope = other block."""
    block_hash: bytes
    """The block's full 32-byte chained prefix hash: what names it to Redis and KV events."""
    scope_name: bytes = field(default=b"", compare=False)
    """The tenant scope's name that ``scope`` digests (UTF-8), kept in the slot header so a
    restarted node can name the block's owner; not part of the key (``scope`` is)."""

    def __post_init__(self) -> None:
        if len(self.namespace) != NAMESPACE_BYTES:
            raise ValueError(
                f"DiskKey.namespace is {len(self.namespace)} bytes, not {NAMESPACE_BYTES}"
            )
        if not 0 <= self.scope <= U64:
            raise ValueError("DiskKey.scope is an unsigned 64-bit integer")
        if len(self.scope_name) > SCOPE_NAME_BYTES:
            raise ValueError(f"DiskKey.scope_name is longer than {SCOPE_NAME_BYTES} bytes")
        if len(self.block_hash) != HASH_BYTES:
            raise ValueError(
                f"DiskKey.block_hash is {len(self.block_hash)} bytes, not {HASH_BYTES}"
            )


def round_up(n: int, unit: int = PAGE) -> int:
    """``n`` rounded up to a multiple of ``unit``."""
    return -(-n // unit) * unit


def slot_bytes_for(length: int) -> int:
    """The slot size of a block of ``length`` payload bytes: header page + payload pages."""
    return PAGE + round_up(max(length, 1))


def _seal(body: bytes) -> bytes:
    page = bytearray(PAGE)
    page[: len(body)] = body
    page[len(body) : len(body) + _TAIL.size] = _TAIL.pack(xxhash.xxh3_64_intdigest(body))
    return bytes(page)


def _unseal(page: Page, layout: struct.Struct, magic: bytes) -> tuple[object, ...] | None:
    """The header's fields, or None when the magic or the header's own checksum is wrong."""
    if bytes(page[:8]) != magic:
        return None
    body = page[: layout.size]
    (stored,) = _TAIL.unpack_from(page, layout.size)
    if xxhash.xxh3_64_intdigest(body) != stored:
        return None
    return layout.unpack_from(page)


@dataclass(frozen=True, slots=True)
class Superblock:
    """The file's first page: the region size the file was cut with, and how many."""

    region_bytes: int
    regions: int
    clean: int = 0
    """The stamp of the checkpoint a clean stop wrote; 0 while the tier is open
    (or after a crash): rebuild from the headers."""

    def pack(self) -> bytes:
        return _seal(
            _SUPER.pack(FILE_MAGIC, VERSION, 0, self.region_bytes, self.regions, self.clean)
        )

    @staticmethod
    def version_of(page: Page) -> int | None:
        """The version a sealed superblock of any version names; None if it is none."""
        fields = _unseal(page, _SUPER, FILE_MAGIC)
        return None if fields is None else int(fields[1])  # type: ignore[call-overload]

    @classmethod
    def parse(cls, page: Page) -> Superblock | None:
        fields = _unseal(page, _SUPER, FILE_MAGIC)
        if fields is None or fields[1] != VERSION:
            return None
        _, _, _, region_bytes, regions, clean = fields
        assert isinstance(region_bytes, int) and isinstance(regions, int) and isinstance(clean, int)
        return cls(region_bytes, regions, clean)


@dataclass(frozen=True, slots=True)
class RegionHeader:
    """A region's first page: the slot size its slots have while this epoch lasts."""

    slot_bytes: int
    epoch: int
    index: int

    def pack(self) -> bytes:
        return _seal(_REGION.pack(REGION_MAGIC, VERSION, self.slot_bytes, self.epoch, self.index))

    @classmethod
    def parse(cls, page: Page) -> RegionHeader | None:
        fields = _unseal(page, _REGION, REGION_MAGIC)
        if fields is None or fields[1] != VERSION:
            return None
        _, _, slot_bytes, epoch, index = fields
        assert isinstance(slot_bytes, int) and isinstance(epoch, int) and isinstance(index, int)
        return cls(slot_bytes, epoch, index)


@dataclass(frozen=True, slots=True)
class SlotHeader:
    """A slot's first page: which block the payload after it is, and its checksum."""

    slot_bytes: int
    epoch: int
    namespace: bytes
    scope: int
    block_hash: bytes
    length: int
    checksum: int
    seq: int
    """Write sequence number: the LRU order the rebuild restores."""
    scope_name: bytes = b""
    """The tenant scope's name (UTF-8, at most `SCOPE_NAME_BYTES`), which ``scope`` digests."""

    def pack(self) -> bytes:
        return _seal(
            _SLOT.pack(
                SLOT_MAGIC,
                VERSION,
                self.slot_bytes,
                self.epoch,
                self.namespace,
                self.scope,
                self.block_hash,
                self.length,
                self.checksum,
                self.seq,
                len(self.scope_name),
                self.scope_name,
            )
        )

    def matches(self, page: Page) -> bool:
        """Whether ``page`` holds exactly this header (a read's identity check).

        The bytes a writer packs are compared, its own checksum included: one
        ``memcmp`` instead of a parse (equal bytes parse to an equal header;
        the tier's writers only ever write `pack`'s bytes)."""
        return bytes(page[:SLOT_HEADER_BYTES]) == self.pack()[:SLOT_HEADER_BYTES]

    @classmethod
    def parse(cls, page: Page) -> SlotHeader | None:
        fields = _unseal(page, _SLOT, SLOT_MAGIC)
        if fields is None or fields[1] != VERSION:
            return None
        name_len, name = fields[10:]
        assert isinstance(name_len, int) and isinstance(name, bytes)
        if name_len > SCOPE_NAME_BYTES:
            return None
        return cls(*fields[2:10], name[:name_len])  # type: ignore[arg-type, call-arg]


def is_blank(page: Page) -> bool:
    """True for a page whose magic is zero (never written, or invalidated)."""
    return bytes(page[:8]) == bytes(8)


def checkpoint_bytes(regions: int, region_bytes: int) -> int:
    """The checkpoint area of a file of ``regions``: room for every slot of the
    smallest size (8 KiB) as a block record, every region, and its header page."""
    slots = regions * slots_per_region(region_bytes, 2 * PAGE)
    fixed = CHECKPOINT_SCOPES * CHECKPOINT_SCOPE.size
    return PAGE + round_up(slots * CHECKPOINT_ENTRY.size + regions * CHECKPOINT_REGION.size + fixed)


def data_bytes(capacity_bytes: int, region_bytes: int) -> tuple[int, int]:
    """(regions, file bytes) of the largest file that fits in ``capacity_bytes``."""
    per_region = region_bytes + slots_per_region(region_bytes, 2 * PAGE) * CHECKPOINT_ENTRY.size
    per_region += CHECKPOINT_REGION.size
    fixed = CHECKPOINT_SCOPES * CHECKPOINT_SCOPE.size
    regions = max(0, (capacity_bytes - DATA_START - 2 * PAGE - fixed) // per_region)
    # The estimate is off by a region at most (the area rounds up to pages).
    while file_bytes_for(regions + 1, region_bytes) <= capacity_bytes:
        regions += 1
    while regions and file_bytes_for(regions, region_bytes) > capacity_bytes:
        regions -= 1
    return regions, file_bytes_for(regions, region_bytes)


def file_bytes_for(regions: int, region_bytes: int) -> int:
    """The size of a file of ``regions`` regions, its checkpoint area included."""
    return checkpoint_offset(regions, region_bytes) + checkpoint_bytes(regions, region_bytes)


def checkpoint_offset(regions: int, region_bytes: int) -> int:
    """Where the checkpoint area starts: after the last region."""
    return DATA_START + regions * region_bytes


@dataclass(frozen=True, slots=True)
class CheckpointHeader:
    """The checkpoint area's first page: how many records follow, and their checksum."""

    stamp: int
    entries: int
    limbo: int
    regions: int
    next_seq: int
    next_epoch: int
    records_checksum: int
    scopes: int = 0
    """Scope names (`CHECKPOINT_SCOPE`) after the region records."""

    def records_bytes(self) -> int:
        return (
            self.entries * CHECKPOINT_ENTRY.size
            + self.limbo * CHECKPOINT_SLOT.size
            + self.regions * CHECKPOINT_REGION.size
            + self.scopes * CHECKPOINT_SCOPE.size
        )

    def pack(self) -> bytes:
        body = _CHECKPOINT.pack(
            CHECKPOINT_MAGIC,
            VERSION,
            self.scopes,
            self.stamp,
            self.entries,
            self.limbo,
            self.regions,
            self.next_seq,
            self.next_epoch,
            self.records_checksum,
        )
        return _seal(body)

    @classmethod
    def parse(cls, page: Page) -> CheckpointHeader | None:
        fields = _unseal(page, _CHECKPOINT, CHECKPOINT_MAGIC)
        if fields is None or fields[1] != VERSION:
            return None
        return cls(*fields[3:], fields[2])  # type: ignore[arg-type, call-arg]


def region_offset(region: int, region_bytes: int) -> int:
    """The file offset of region ``region``'s header page."""
    return DATA_START + region * region_bytes


def slots_per_region(region_bytes: int, slot_bytes: int) -> int:
    """How many slots of ``slot_bytes`` a region holds after its header page."""
    return (region_bytes - PAGE) // slot_bytes


def slot_offset(region: int, slot: int, region_bytes: int, slot_bytes: int) -> int:
    """The file offset of a slot's header page."""
    return DATA_START + region * region_bytes + PAGE + slot * slot_bytes
