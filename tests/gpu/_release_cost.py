"""What waiting for the reads costs a release: ``python -m tests.gpu._release_cost``.

Starts a node on cuda:0, stores 8 blocks, then times ``release`` of a pinned
hit whose views were just read (a copy on the current stream), three ways,
median of RUNS each, in microseconds:

* ``release_us``: the default (an event on the current stream, waited for in
  a worker thread, then Release);
* ``release_presynced_us``: the reads synchronised by the caller first,
  ``release(streams=())`` (Release alone: the baseline);
* ``sync_then_release_us``: the caller's own ``synchronize()`` plus that
  release (what a careful runner paid before).

Prints one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time

import torch

from benchmarks._server import ServerProcess
from kvstore.client import Client
from kvstore.layout import KVLayout

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
BLOCKS = 8
RUNS = 50


async def measure(address: str) -> dict[str, object]:
    async with Client(address, tenant="release-cost", timeout=30.0) as kv:
        ns = await kv.register_namespace("release-cost", LAYOUT)
        tokens = list(range(BLOCKS * LAYOUT.block_size))
        src = [
            torch.randn(LAYOUT.block_shape, device="cuda").to(torch.bfloat16) for _ in range(BLOCKS)
        ]
        await kv.store(ns, tokens, src)
        out = torch.empty((BLOCKS, *LAYOUT.block_shape), dtype=torch.bfloat16, device="cuda")
        times: dict[str, list[float]] = {"default": [], "presynced": [], "sync_then": []}
        for _ in range(RUNS + 1):
            for mode, samples in times.items():
                hit = await kv.lookup(ns, tokens, pin=True)
                for i, v in enumerate(hit.torch_views()):
                    out[i].copy_(v)
                if mode == "presynced":
                    torch.cuda.current_stream().synchronize()
                start = time.perf_counter()
                if mode == "default":
                    await kv.release(hit)
                else:
                    if mode == "sync_then":
                        torch.cuda.current_stream().synchronize()
                    await kv.release(hit, streams=())
                samples.append(time.perf_counter() - start)
        med = {k: statistics.median(v[1:]) * 1e6 for k, v in times.items()}
        return {
            "blocks": BLOCKS,
            "block_bytes": LAYOUT.block_bytes,
            "release_us": round(med["default"], 1),
            "release_presynced_us": round(med["presynced"], 1),
            "sync_then_release_us": round(med["sync_then"], 1),
        }


def main() -> None:
    torch.cuda.init()
    with (
        tempfile.TemporaryDirectory() as tmp,
        ServerProcess.start(
            tmp,
            capacity="256MiB",
            extra_args=("--device", "cuda:0"),
            ready_timeout=120.0,  # a first CUDA context takes a while
        ) as node,
    ):
        result = asyncio.run(measure(node.target))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
