"""CUDA pool benchmark: IPC-mapped block bandwidth and the cost of loading a prefix.

Needs cupy and a GPU. Starts a node (``python -m service --device cuda:0``)
and acts as a runner in this process, so the slots are a real cross-process
CUDA IPC mapping. Prints one JSON object:

* ``write_gbps`` / ``read_gbps``: block copies into / out of mapped slots;
* ``baseline_gbps``: the same copies between two plain torch allocations,
  measured in the same run; ``*_ratio`` = mapped / baseline;
* ``prefix_load_ms``: lookup (pin) + views + copying 512 blocks into a
  runner buffer + synchronise + release, median of the runs; ``prefix_rpc_ms``
  the lookup and release alone.

    python -m benchmarks.bench_cuda [--blocks 512] [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from benchmarks._server import ServerProcess
from kvstore.client import Client
from kvstore.layout import KVLayout
from kvstore.types import SlotId

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
"""A Llama-3-8B-like layout: 2 MiB blocks."""


def timed(fn: Callable[[], None], runs: int) -> float:
    """Median seconds of ``runs`` calls, each ended by a device synchronise."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def bench(address: str, blocks: int, runs: int) -> dict[str, object]:
    async with Client(address, tenant="bench", timeout=60.0) as kv:
        capacity = 2 * blocks * LAYOUT.block_bytes
        ns = await kv.register_namespace("bench-cuda", LAYOUT, capacity_bytes=capacity)
        mapping = ns.mapping
        assert mapping is not None and mapping.descriptor.kind == "cuda"
        gb = blocks * LAYOUT.block_bytes / 1e9
        # Slots of the second half of the pool: raw bandwidth, outside the protocol.
        slots = [SlotId(blocks + i) for i in range(blocks)]
        views = [mapping.torch_view(s, LAYOUT) for s in slots]
        src = [torch.randn(LAYOUT.block_shape, device="cuda").to(torch.bfloat16) for _ in slots]
        dst = [torch.empty_like(t) for t in src]

        def write() -> None:
            for v, s in zip(views, src, strict=True):
                v.copy_(s)

        def read() -> None:
            for v, d in zip(views, dst, strict=True):
                d.copy_(v)

        def baseline() -> None:
            for s, d in zip(src, dst, strict=True):
                d.copy_(s)

        t_write, t_read, t_base = timed(write, runs), timed(read, runs), timed(baseline, runs)
        read()
        torch.cuda.synchronize()
        exact = all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
        views.clear()  # drop the views before the protocol reuses the slots

        tokens = list(range(blocks * LAYOUT.block_size))
        stored = await kv.store(ns, tokens, src)
        out = torch.empty((blocks, *LAYOUT.block_shape), dtype=torch.bfloat16, device="cuda")
        load_times, rpc_times = [], []
        for _ in range(runs + 1):
            start = time.perf_counter()
            hit = await kv.lookup(ns, tokens, pin=True)
            rpc = time.perf_counter() - start
            for i, v in enumerate(hit.torch_views()):
                out[i].copy_(v)
            torch.cuda.current_stream().synchronize()
            start_release = time.perf_counter()
            await kv.release(hit)
            end = time.perf_counter()
            rpc += end - start_release
            load_times.append(end - start)
            rpc_times.append(rpc)
        return {
            "device": torch.cuda.get_device_name(),
            "block_bytes": LAYOUT.block_bytes,
            "blocks": blocks,
            "write_gbps": round(gb / t_write, 1),
            "read_gbps": round(gb / t_read, 1),
            "baseline_gbps": round(gb / t_base, 1),
            "write_ratio": round(t_base / t_write, 3),
            "read_ratio": round(t_base / t_read, 3),
            "read_exact": exact,
            "prefix_committed": stored.committed,
            "prefix_hit_blocks": hit.hit_blocks,
            "prefix_load_ms": round(statistics.median(load_times[1:]) * 1e3, 2),
            "prefix_rpc_ms": round(statistics.median(rpc_times[1:]) * 1e3, 2),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.cuda.init()
    capacity = 2 * args.blocks * LAYOUT.block_bytes + (64 << 20)
    with tempfile.TemporaryDirectory() as tmp, ServerProcess.start(
        tmp,
        capacity=str(capacity),
        extra_args=(
            "--device", "cuda:0", "--namespace-capacity-bytes", str(capacity),
            "--arena-bytes", "1GiB", "--max-message-bytes", "64MiB",
        ),
        ready_timeout=120.0,  # a first CUDA context takes a while
    ) as node:  # fmt: skip
        result = asyncio.run(bench(node.target, args.blocks, args.runs))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
