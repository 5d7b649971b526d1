"""The disk tier across real node processes: a clean stop, a new process, the same file.

The first node stores blocks through the SDK and is stopped with SIGTERM
(which flushes the tier); a second process started on the same tier file
has empty memory and serves the blocks again, byte for byte, promoted from
disk. A path the tier cannot use stops the node at start with one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from benchmarks._server import SALT_SECRET, ServerProcess
from kvstore.client import Client
from kvstore.layout import KVLayout
from tests.e2e.processes import shm_parent

pytestmark = pytest.mark.e2e

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")
"""16 KiB blocks: whole pages, read from disk straight into the pool's slots."""

BLOCKS = 8
TOKENS = list(range(BLOCKS * LAYOUT.block_size))


async def test_a_restarted_node_serves_its_blocks_from_disk_byte_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    blocks = [rng.integers(0, 256, LAYOUT.block_bytes, np.uint8).tobytes() for _ in range(BLOCKS)]
    disk = ("--disk-path", str(tmp_path / "kvstore.disk"), "--disk-capacity-bytes", "80MiB")
    with tempfile.TemporaryDirectory(prefix="kvstore-disk-", dir=shm_parent()) as shm:
        first = ServerProcess.start(shm, extra_args=disk, prefix_stem="kvdisk")
        try:
            async with Client(first.target) as kv:
                ns = await kv.register_namespace("disk-restart", LAYOUT)
                assert (await kv.store(ns, TOKENS, blocks)).committed == BLOCKS
        finally:
            status = first.stop()  # SIGTERM: the tier is flushed before the node exits
        assert status == 0, first.log_tail()
        second = ServerProcess.start(shm, extra_args=disk, prefix_stem="kvdisk")
        try:
            async with Client(second.target) as kv:
                ns = await kv.register_namespace("disk-restart", LAYOUT)
                hit = await kv.lookup(ns, TOKENS, pin=True)
                assert hit.hit_blocks == BLOCKS
                assert hit.verify().ok  # the stamps of the promoted blocks' slots
                assert await kv.read_blocks(hit) == blocks
                await kv.release(hit)
        finally:
            status = second.stop()
        assert status == 0, second.log_tail()


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("missing/kvstore.disk", "no such folder"),
        (".", "a folder; name a file in it"),
        ("not-a-tier", "not a kvstore disk tier file"),
    ],
)
def test_a_bad_disk_path_stops_the_node_with_one_line(
    tmp_path: Path, where: str, expected: str
) -> None:
    (tmp_path / "not-a-tier").write_bytes(b"someone else's file" * 300)
    with tempfile.TemporaryDirectory(prefix="kvstore-disk-", dir=shm_parent()) as shm:
        done = subprocess.run(
            [
                sys.executable, "-m", "service", "--port", "0", "--metrics-port", "0",
                "--shm-dir", shm, "--salt-secret", SALT_SECRET, "--log-level", "WARNING",
                "--disk-path", os.path.join(tmp_path, where),
            ],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "listening" not in done.stdout  # failed before a port was bound
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("kvstore-server: disk_path ") and expected in lines[0]
