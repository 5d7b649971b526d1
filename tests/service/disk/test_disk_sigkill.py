"""SIGKILL during a stream of writes, then reopen: nothing served differs from what was written.

A child process streams blocks into a small tier (so slots are reused while
it writes: evictions, invalidations, region steals between two sizes) and
is killed with SIGKILL mid-stream. The reopened tier may have lost blocks,
never served wrong ones.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from service.disk import DiskKey, DiskTier
from service.disk.format import file_bytes_for

ROOT = Path(__file__).resolve().parents[3]
NS = b"k" * 16
REGION = 1 << 20
CAP = file_bytes_for(6, REGION)

CHILD = """
import asyncio, sys
import numpy as np
from service.disk import DiskKey, DiskTier, DiskEventKind

def payload(h):
    size = (96 << 10) if h % 3 else (200 << 10) + 123
    return np.random.default_rng(h).integers(0, 256, size=size, dtype=np.uint8).tobytes()

async def main(path):
    tier = DiskTier.open(path, int(sys.argv[2]), region_bytes=int(sys.argv[3]), queue_blocks=16)
    h = int(sys.argv[4])
    while True:
        data = payload(h)
        if tier.offer(DiskKey(b"k" * 16, 0, h.to_bytes(32, "little")), data, 0):
            h += 1
        else:
            await asyncio.sleep(0.0005)
        for e in tier.take_events():
            if e.kind is DiskEventKind.STORED:
                print(int.from_bytes(e.key.block_hash, "little"), flush=True)

asyncio.run(main(sys.argv[1]))
"""


def payload(h: int) -> bytes:
    size = (96 << 10) if h % 3 else (200 << 10) + 123
    return np.random.default_rng(h).integers(0, 256, size=size, dtype=np.uint8).tobytes()


def test_sigkill_mid_stream_then_reopen_serves_only_what_was_written(tmp_path: Path) -> None:
    path = str(tmp_path / "tier.disk")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for round_ in range(3):  # each round reopens what the last one's kill left
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, path, str(CAP), str(REGION), str(1000 * round_)],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert child.stdout is not None
        stored = 0
        deadline = time.monotonic() + 60
        while stored < 150 + 50 * round_ and time.monotonic() < deadline:
            if child.stdout.readline():
                stored += 1
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
        assert stored >= 150, "the child wrote too little before the kill"

        asyncio.run(check_reopened(path, round_))


async def check_reopened(path: str, round_: int) -> None:
    """Every block the reopened tier serves has the bytes it was written with."""
    tier = DiskTier.open(path, CAP)
    served = failed = 0
    for h in range(1000 * (round_ + 1)):
        key = DiskKey(NS, 0, h.to_bytes(32, "little"))
        length = tier.length_of(key)
        if length is None:
            continue
        dest = memoryview(bytearray(length))
        if await tier.read_into(key, dest):
            assert bytes(dest) == payload(h), f"block {h} served with bytes it was not written with"
            served += 1
        else:
            failed += 1
    s = tier.stats()
    assert s.opened_from == "headers", "a killed tier left no clean checkpoint"
    assert served > 10, f"round {round_}: {served} blocks survived ({failed} discarded)"
    print(
        f"round {round_}: {served} served after the kill, {failed} discarded, "
        f"{s.discarded_at_open} headers discarded at open"
    )
    assert failed == s.read_failures_checksum + s.read_failures_identity
    await tier.close()
