"""A block on disk keeps what names it after a restart: its full hash and its scope's name.

The Redis directory and KV events name a block by (namespace, 32-byte hash,
tenant scope); a restarted node has only the file to go by.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import pytest
import xxhash

from kvstore.checksum import block_checksum
from service.disk.format import PAGE, DiskKey, Superblock, file_bytes_for
from service.disk.io import DiskTierError
from service.disk.tier import DiskEventKind, DiskTier

NS = b"i" * 16
REGION = 1 << 20
CAP = file_bytes_for(4, REGION)
DATA = bytes(range(256)) * 64


def full_hash(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "little")).digest()


def key(i: int, scope: int = 7, name: bytes = b"tenant-a") -> DiskKey:
    return DiskKey(NS, scope, full_hash(i), name)


async def write(path: str, n: int) -> DiskTier:
    tier = DiskTier.open(path, CAP, region_bytes=REGION)
    for i in range(n):
        assert tier.offer(key(i), DATA, block_checksum(DATA))
    assert tier.offer(DiskKey(NS, 9, full_hash(100), b""), DATA, 0)  # the shared scope
    assert await tier.flush(10)
    return tier


@pytest.mark.parametrize("clean", [True, False], ids=["checkpoint", "headers"])
async def test_full_hash_and_scope_name_survive_a_restart(tmp_path: Path, clean: bool) -> None:
    path = str(tmp_path / "tier.disk")
    tier = await write(path, 5)
    stored = [e.key for e in tier.take_events() if e.kind is DiskEventKind.STORED]
    assert {k.block_hash for k in stored} == {full_hash(i) for i in (*range(5), 100)}
    await tier.close(checkpoint=clean)

    again = DiskTier.open(path, CAP)
    assert again.stats().opened_from == ("checkpoint" if clean else "headers")
    assert again.scope_names == {7: b"tenant-a", 9: b""}
    assert again.run_length(NS, 7, [full_hash(i) for i in range(6)]) == 5
    assert again.run_length(NS, 7, [full_hash(0)[:8] + bytes(24)]) == 0, "8 bytes name nothing"
    dest = memoryview(bytearray(len(DATA)))
    assert await again.read_into(key(3), dest) and bytes(dest) == DATA
    await again.close()


async def test_a_block_whose_header_names_another_scope_is_not_served(tmp_path: Path) -> None:
    path = str(tmp_path / "tier.disk")
    tier = await write(path, 1)
    tier.scope_names[7] = b"tenant-b"  # what the header is checked against
    dest = memoryview(bytearray(len(DATA)))
    assert not await tier.read_into(key(0), dest), "identity is checked, scope name included"
    await tier.close(checkpoint=False)


def test_a_file_of_the_previous_version_is_refused_in_one_line(tmp_path: Path) -> None:
    path = str(tmp_path / "tier.disk")
    DiskTier.open(path, CAP, region_bytes=REGION)._file.close()
    with open(path, "r+b") as f:  # what a version 1 node left: its superblock says 1
        page = bytearray(f.read(PAGE))
        assert Superblock.parse(page) is not None
        struct.pack_into("<I", page, 8, 1)
        body_len = 8 + 4 + 4 + 8 + 8 + 8  # the superblock's fields, then their xxh3-64
        struct.pack_into("<Q", page, body_len, xxhash.xxh3_64_intdigest(bytes(page[:body_len])))
        f.seek(0)
        f.write(page)
        f.flush()
        os.fsync(f.fileno())
    with pytest.raises(DiskTierError, match=r"^disk_path .* is a version 1 disk tier file") as err:
        DiskTier.open(path, CAP)
    assert "\n" not in str(err.value) and "remove it" in str(err.value)


async def test_more_scopes_than_a_checkpoint_holds_rebuild_from_the_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("service.disk.checkpoint.CHECKPOINT_SCOPES", 1)
    path = str(tmp_path / "tier.disk")
    tier = DiskTier.open(path, CAP, region_bytes=REGION)
    for i, name in enumerate((b"t1", b"t2")):
        assert tier.offer(DiskKey(NS, i + 1, full_hash(i), name), DATA, 0)
    assert await tier.flush(10)
    await tier.close()  # two scope names, room for one: no checkpoint, never a torn one
    again = DiskTier.open(path, CAP)
    assert again.stats().opened_from == "headers"
    assert again.scope_names == {1: b"t1", 2: b"t2"} and again.stats().blocks == 2
    await again.close()
