"""The disk tier under a CUDA pool on a real GPU: to disk and back, across a restart.

The node copies a committed CUDA slot to the host in a worker thread and
writes it behind; a lookup on a restarted node reads the block into host
staging and writes it into a slot of the new pool (docs/disk.md). The fake
runtime runs the same code on the CPU (tests/service/test_disk_node.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from benchmarks._server import ServerProcess
from kvstore.client import Client
from kvstore.layout import KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
BLOCKS = 6
TOKENS = list(range(BLOCKS * LAYOUT.block_size))


async def test_cuda_blocks_go_to_disk_and_come_back_after_a_restart(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    blocks = [rng.integers(0, 256, LAYOUT.block_bytes, np.uint8).tobytes() for _ in range(BLOCKS)]
    args = (
        "--device", "cuda:0",
        "--disk-path", str(tmp_path / "kvstore.disk"), "--disk-capacity-bytes", "256MiB",
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvstore-gpu-disk-") as shm:
        for attempt in ("store", "read back"):
            node = ServerProcess.start(shm, capacity="256MiB", extra_args=args)
            try:
                async with Client(node.target, map_pool=False) as kv:
                    ns = await kv.register_namespace("gpu-disk", LAYOUT)
                    if attempt == "store":
                        assert (await kv.store(ns, TOKENS, blocks)).committed == BLOCKS
                        continue
                    hit = await kv.lookup(ns, TOKENS, pin=True)
                    assert hit.hit_blocks == BLOCKS
                    assert await kv.read_blocks(hit) == blocks
                    await kv.release(hit)
            finally:
                status = node.stop()
            assert status == 0, node.log_tail()
