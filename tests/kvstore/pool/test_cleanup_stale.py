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


def test_a_live_pid_without_the_lock_is_stale(pool_dir: Path) -> None:
    # In a container the next node is often pid 1 again: a file named after a
    # live pid that no server holds locked belongs to a dead node (SIGKILL).
    # Here: a file named after this very process, but never locked.
    orphan = pool_dir / f"kvstore-{os.getpid()}-1f-{NS}-0"
    orphan.write_bytes(b"x")
    with HostPool.create(NS, 64, 2, 0x2F, directory=str(pool_dir)) as live:
        assert cleanup_stale(str(pool_dir), "kvstore") == [str(orphan)]
        assert os.path.exists(live.descriptor.arenas[0].path)


def test_a_killed_servers_files_are_stale_even_when_its_pid_is_taken(pool_dir: Path) -> None:
    # A child creates a pool and is SIGKILLed; its files carry its pid. Rename them
    # to this live process's pid, as a recycled pid (or pid 1 in a container) would.
    code = (
        "import os, signal, sys\n"
        "from kvstore.pool import HostPool\n"
        f"pool = HostPool.create({NS!r}, 64, 2, 0x3F, directory={str(pool_dir)!r})\n"
        "print(pool.descriptor.arenas[0].path, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    left = Path(proc.stdout.split()[0])
    assert left.exists()
    renamed = pool_dir / left.name.replace(f"-{left.name.split('-')[1]}-", f"-{os.getpid()}-", 1)
    left.rename(renamed)
    # Its stamp file too: same name with "-stamps", same pid, same (dropped) lock.
    stamps = Path(f"{left}-stamps")
    assert stamps.exists()
    stamps.rename(f"{renamed}-stamps")
    assert cleanup_stale(str(pool_dir), "kvstore") == [str(renamed), f"{renamed}-stamps"]
