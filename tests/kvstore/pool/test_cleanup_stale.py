"""cleanup_stale: files of dead server processes go, files of live ones stay."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvstore.pool import HostPool, cleanup_stale

from .conftest import NS


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_removes_dead_keeps_live(pool_dir: Path) -> None:
    dead = _dead_pid()
    stale = [pool_dir / f"kvstore-{dead}-1f-{NS}-{i}" for i in range(2)]
    for path in stale:
        path.write_bytes(b"x")
    other_prefix = pool_dir / f"other-{dead}-1f-{NS}-0"
    other_prefix.write_bytes(b"x")
    odd = pool_dir / "kvstore-notapid-1"
    odd.write_bytes(b"x")
    with HostPool.create(NS, 64, 2, 0x2F, directory=str(pool_dir)) as live:
        removed = cleanup_stale(str(pool_dir), "kvstore")
        assert sorted(removed) == sorted(str(p) for p in stale)
        assert not any(p.exists() for p in stale)
        assert os.path.exists(live.descriptor.arenas[0].path)
        assert other_prefix.exists() and odd.exists()
    assert cleanup_stale(str(pool_dir), "kvstore") == []


def test_prefix_with_dashes(pool_dir: Path) -> None:
    dead = _dead_pid()
    stale = pool_dir / f"kv-store-{dead}-1-{NS}-0"
    stale.write_bytes(b"")
    assert cleanup_stale(str(pool_dir), "kv-store") == [str(stale)]


def test_missing_directory(tmp_path: Path) -> None:
    assert cleanup_stale(str(tmp_path / "nope"), "kvstore") == []
