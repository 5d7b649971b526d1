"""The checkpoint a clean stop leaves, so the next open skips the header scan.

A clean `DiskTier.close` writes the index (`DiskIndex.snapshot`) into the
file's checkpoint area, syncs it, then stamps the superblock with the
checkpoint's random stamp and syncs that. The next open believes the
checkpoint only when both stamps agree and the records' xxh3-64 holds, and
clears the superblock's stamp (synced) before the tier writes anything: a
crash after that leaves a stamp of 0, and the open after it scans the
headers (`service.disk.rebuild`). A block the checkpoint names is still
verified (header and payload checksum) when it is read.

Reading 88 bytes a block instead of a page: 100k blocks load in well
under a second where the scan reads every slot header (see
benchmarks/README.md, "bench_disk").
"""

from __future__ import annotations

import os
import secrets

import xxhash

from service.disk.format import (
    CHECKPOINT_ENTRY,
    CHECKPOINT_REGION,
    CHECKPOINT_SCOPE,
    CHECKPOINT_SCOPES,
    CHECKPOINT_SLOT,
    PAGE,
    SCOPE_NAME_BYTES,
    CheckpointHeader,
    Superblock,
    checkpoint_bytes,
    checkpoint_offset,
    round_up,
    slots_per_region,
)
from service.disk.index import Snapshot
from service.disk.io import TierFile, aligned


def write_superblock(file: TierFile, sb: Superblock) -> None:
    """Write the superblock page and sync it (and everything written before it)."""
    page = aligned(PAGE)
    page.write(sb.pack())
    file.write([page], 0)
    os.fsync(file.fd)


def write_checkpoint(
    file: TierFile, sb: Superblock, snap: Snapshot, scopes: dict[int, bytes] | None = None
) -> Superblock:
    """Write ``snap`` and the scope names into the checkpoint area, then stamp the
    superblock; blocking.

    Returns the superblock as written. The records must fit the area (they
    do: it has room for a block in every slot of the smallest size, and for
    `CHECKPOINT_SCOPES` scope names; with more, no checkpoint is written and
    the next open scans the headers).
    """
    scopes = scopes or {}
    if len(scopes) > CHECKPOINT_SCOPES:
        return sb
    records = b"".join(
        [
            *(
                CHECKPOINT_ENTRY.pack(region, slot, seq, key[0], key[1], key[2], length, checksum)
                for region, slot, seq, key, length, checksum in snap.entries
            ),
            *(CHECKPOINT_SLOT.pack(region, slot) for region, slot in snap.limbo),
            *(CHECKPOINT_REGION.pack(*r) for r in snap.regions),
            *(CHECKPOINT_SCOPE.pack(s, len(n), n) for s, n in scopes.items()),
        ]
    )
    area = checkpoint_bytes(sb.regions, sb.region_bytes)
    if PAGE + len(records) > area:
        raise RuntimeError(f"bug: a checkpoint of {len(records)} bytes in an area of {area}")
    stamp = secrets.randbits(64) | 1
    header = CheckpointHeader(
        stamp,
        len(snap.entries),
        len(snap.limbo),
        len(snap.regions),
        snap.next_seq,
        snap.next_epoch,
        xxhash.xxh3_64_intdigest(records),
        len(scopes),
    )
    buf = aligned(PAGE + round_up(len(records)))
    buf[:PAGE] = header.pack()
    buf[PAGE : PAGE + len(records)] = records
    file.write([buf], checkpoint_offset(sb.regions, sb.region_bytes))
    os.fdatasync(file.fd)
    clean = Superblock(sb.region_bytes, sb.regions, stamp)
    write_superblock(file, clean)
    return clean


def read_checkpoint(file: TierFile, sb: Superblock) -> Snapshot | None:
    """The snapshot a clean stop left, or None (no stamp, stamps differ, bad bytes)."""
    if not sb.clean:
        return None
    offset = checkpoint_offset(sb.regions, sb.region_bytes)
    page = aligned(PAGE)
    file.read_into([page], offset)
    header = CheckpointHeader.parse(page)
    if header is None or header.stamp != sb.clean:
        return None
    nbytes = header.records_bytes()
    if PAGE + nbytes > checkpoint_bytes(sb.regions, sb.region_bytes):
        return None
    buf = aligned(round_up(nbytes))
    if nbytes:
        file.read_into([buf], offset + PAGE)
    records = memoryview(buf)[:nbytes]
    if xxhash.xxh3_64_intdigest(records) != header.records_checksum:
        return None
    at = header.entries * CHECKPOINT_ENTRY.size
    limbo_end = at + header.limbo * CHECKPOINT_SLOT.size
    entries = [
        (region, slot, seq, (ns, scope, h), length, checksum)
        for region, slot, seq, ns, scope, h, length, checksum in CHECKPOINT_ENTRY.iter_unpack(
            records[:at]
        )
    ]
    limbo = [(region, slot) for region, slot in CHECKPOINT_SLOT.iter_unpack(records[at:limbo_end])]
    regions_end = limbo_end + header.regions * CHECKPOINT_REGION.size
    regions = [
        (i, size, epoch)
        for i, size, epoch in CHECKPOINT_REGION.iter_unpack(records[limbo_end:regions_end])
    ]
    scopes = {
        s: bytes(name[:n])
        for s, n, name in CHECKPOINT_SCOPE.iter_unpack(records[regions_end:])
        if n <= SCOPE_NAME_BYTES
    }
    sizes = {i: size for i, size, _ in regions}
    if any(
        i >= sb.regions or slots_per_region(sb.region_bytes, size) < 1 for i, size in sizes.items()
    ):
        return None
    for region, slot, *_ in entries:
        if region not in sizes or slot >= slots_per_region(sb.region_bytes, sizes[region]):
            return None
    if any(region not in sizes for region, _ in limbo):
        return None
    return Snapshot(regions, entries, limbo, header.next_seq, header.next_epoch, scopes)
