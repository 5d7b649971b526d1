"""Rebuilding the index at open: from a clean stop's checkpoint
(`service.disk.checkpoint`), else from the headers on disk (payloads are not
read).

Each region's header page says its slot size and epoch; then every slot
header page of the region is read (O_DIRECT, ``io_threads`` regions at once)
and believed only when its own checksum holds and it names that slot size
and epoch and a length that fits the slot. A header that fails (torn by a
SIGKILL mid-write, a flipped bit) is discarded and counted; a header of
another epoch is a leftover of the region's earlier use and skipped
silently. Payload checksums are verified when a block is read back, not
here: the rebuild reads one page per block.

Small slots are read in runs (one ``preadv`` of many slots, headers picked
out), large ones a header page at a time: whichever moves fewer bytes per
header; see `RUN_BYTES`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from service.disk.checkpoint import read_checkpoint, write_superblock
from service.disk.format import (
    PAGE,
    RegionHeader,
    SlotHeader,
    Superblock,
    is_blank,
    region_offset,
    slot_offset,
    slots_per_region,
)
from service.disk.index import DiskIndex, Found
from service.disk.io import TierFile, aligned

RUN_BYTES = 1 << 20
"""Slots of at most ``RUN_BYTES / 16`` are read in runs of up to this many bytes."""


@dataclass(slots=True)
class RegionScan:
    index: int
    header: RegionHeader | None = None
    found: list[Found] = field(default_factory=list)
    discarded: int = 0
    scopes: dict[int, bytes] = field(default_factory=dict)


def _scan_region(file: TierFile, sb: Superblock, index: int) -> RegionScan:
    out = RegionScan(index)
    page = aligned(PAGE)
    file.read_into([page], region_offset(index, sb.region_bytes))
    header = RegionHeader.parse(page)
    if header is None:
        out.discarded += 0 if is_blank(page) else 1
        return out
    count = slots_per_region(sb.region_bytes, header.slot_bytes)
    if header.index != index or count < 1:
        out.discarded += 1
        return out
    out.header = header
    size = header.slot_bytes
    per_run = max(1, RUN_BYTES // size) if size * 16 <= RUN_BYTES else 1
    buf = aligned(per_run * size)
    view = memoryview(buf)
    for first in range(0, count, per_run):
        n = min(per_run, count - first)
        offset = slot_offset(index, first, sb.region_bytes, size)
        if per_run == 1:
            file.read_into([view[:PAGE]], offset)
        else:
            file.read_into([view[: n * size]], offset)
        for j in range(n):
            hdr = view[j * size : j * size + PAGE]
            if is_blank(hdr):
                continue
            slot = SlotHeader.parse(hdr)
            if slot is None:
                out.discarded += 1
                continue
            if slot.epoch != header.epoch or slot.slot_bytes != size:
                continue  # left from the region's earlier use: stale, not torn
            if PAGE + slot.length > size:
                out.discarded += 1
                continue
            key = (slot.namespace, slot.scope, slot.block_hash)
            out.found.append((slot.seq, first + j, key, slot.length, slot.checksum))
            out.scopes[slot.scope] = slot.scope_name
    return out


def scan(file: TierFile, sb: Superblock, threads: int) -> Iterator[RegionScan]:
    """Every region's header and valid slot headers, ``threads`` regions read at
    once; yielded in region order as they are read, so the caller's work on one
    overlaps the reads of the next."""
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvstore-disk-scan") as pool:
        yield from pool.map(lambda i: _scan_region(file, sb, i), range(sb.regions))


@dataclass(frozen=True, slots=True)
class Rebuilt:
    superblock: Superblock
    """The superblock as it is now (its clean stamp cleared)."""
    source: str
    """"checkpoint" or "headers"."""
    discarded: int
    """Headers found torn or corrupt."""
    seconds: float
    scopes: dict[int, bytes] = field(default_factory=dict)
    """Tenant scope names (`DiskKey.scope_name`) by their u64 digest."""


def rebuild_index(
    file: TierFile, sb: Superblock, index: DiskIndex, threads: int, zero: Any
) -> Rebuilt:
    """Fill a new ``index`` from the file; blocking. ``zero``: an aligned zero page.

    The superblock's clean stamp is cleared (synced) before this returns, and
    the slots found in limbo (or holding a block found twice) are zeroed.
    """
    started = time.perf_counter()
    discarded = 0
    snap = read_checkpoint(file, sb)
    scopes: dict[int, bytes] = {}
    if snap is not None:
        index.restore(snap)
        scopes = snap.scopes
    else:
        for r in scan(file, sb, threads):
            discarded += r.discarded
            scopes.update(r.scopes)
            if r.header is not None:
                index.adopt_region(r.index, r.header, r.found)
        index.adopted()
    if sb.clean:  # from here on the checkpoint is stale: never believe it again
        sb = Superblock(sb.region_bytes, sb.regions, 0)
        write_superblock(file, sb)
    for offset, region, slot in index.take_invalidations():
        file.zero_page(offset, zero)
        index.invalidated(region, slot)
    source = "headers" if snap is None else "checkpoint"
    return Rebuilt(sb, source, discarded, time.perf_counter() - started, scopes)
