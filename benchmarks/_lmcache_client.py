"""LMCache's side of `bench_lmcache`: store and load blocks through LMCache's own client.

Runs under LMCache's Python (its own venv: ``lmcache`` and its CPU torch), not
the kvstore one, so it imports nothing from kvstore. `bench_lmcache` starts the
legacy LMCache server (``python -m lmcache.v1.server HOST PORT cpu``) and runs

    LMCACHE_PYTHON benchmarks/_lmcache_client.py '<json args>'

The client is LMCache's remote connector for that server
(`lmcache.v1.storage_backend.connector.lm_connector.LMCServerConnector`, the
``lm://`` remote URL), on a `LocalCPUBackend` whose allocator gives the memory
objects, as an LMCache engine does. Per repeat:

* store: copy each block into a memory object (LMCache's staging buffer, as
  its GPU connector does from the KV cache), ``put`` each one (a header and
  the bytes over the TCP socket), then one ``exists`` round trip on the last
  key: the server handles one connection's commands in order, so its answer
  means every put before it was received and stored.
* load: ``get`` each key (header round trip, then ``recv_into`` a freshly
  allocated memory object), then copy each into the destination array.

Prints one JSON object: per repeat store/load seconds and their phases; the
loaded bytes are checked against the stored ones (after the first load).
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from typing import Any

import numpy as np
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend


def wait_listening(host: str, port: int, deadline: float) -> None:
    """Poll until the server accepts a TCP connection (it imports torch first)."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


async def run(args: dict[str, Any]) -> dict[str, Any]:
    layers, tokens, heads, head_dim = (
        args["layers"],
        args["tokens"],
        args["heads"],
        args["head_dim"],
    )
    n = args["blocks"]
    src = np.fromfile(args["data"], dtype=np.uint8).reshape(n, -1)
    block_bytes = src.shape[1]
    src_t = torch.from_numpy(src)
    dst = np.empty_like(src)
    dst.fill(1)  # fault the pages in, as the kvstore side does
    dst_t = torch.from_numpy(dst)

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=tokens,
        local_cpu=False,
        max_local_cpu_size=max(1.0, 3 * n * block_bytes / 2**30),
    )
    meta = LMCacheMetadata(
        "bench", 1, 1, 0, 0, torch.float16, (layers, 2, tokens, heads, head_dim), chunk_size=tokens
    )
    backend = LocalCPUBackend(config, meta)
    loop = asyncio.get_running_loop()
    conn = LMCServerConnector(args["host"], args["port"], loop, backend)
    shape = torch.Size([2, layers, tokens, heads * head_dim])
    keys = [CacheEngineKey("bench", 1, 0, i, torch.float16) for i in range(n)]

    def raw(obj: Any) -> torch.Tensor:
        return obj.tensor.view(-1).view(torch.uint8)

    runs = []
    for rep in range(args["repeats"] + 1):  # rep 0 warms up
        t0 = time.perf_counter()
        objs = []
        for i in range(n):
            obj = backend.allocate(shape, torch.float16, MemoryFormat.KV_2LTD)
            if obj is None:
                raise RuntimeError("LMCache's CPU allocator is full")
            raw(obj).copy_(src_t[i])
            objs.append(obj)
        t1 = time.perf_counter()
        for key, obj in zip(keys, objs, strict=True):
            await conn.put(key, obj)
        if not await conn.exists(keys[-1]):  # barrier: every put was handled
            raise RuntimeError("the last put is not on the server")
        t2 = time.perf_counter()
        for obj in objs:
            obj.ref_count_down()
        dst.fill(0)
        t3 = time.perf_counter()
        loaded = []
        for key in keys:
            obj = await conn.get(key)
            if obj is None:
                raise RuntimeError(f"LMCache lost {key}")
            loaded.append(obj)
        t4 = time.perf_counter()
        for i, obj in enumerate(loaded):
            dst_t[i].copy_(raw(obj))
        t5 = time.perf_counter()
        for obj in loaded:
            obj.ref_count_down()
        if rep == 0 and not np.array_equal(src, dst):
            raise RuntimeError("LMCache loaded other bytes than it stored")
        if rep:
            runs.append(
                {
                    "store": t2 - t0,
                    "store_copy": t1 - t0,
                    "store_wire": t2 - t1,
                    "load": t5 - t3,
                    "load_wire": t4 - t3,
                    "load_copy": t5 - t4,
                }
            )
    await conn.close()
    return {"runs": runs, "block_bytes": block_bytes, "verified": True}


def main() -> None:
    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)  # see bench_lmcache: a pool of torch threads per copy only contends
    wait_listening(args["host"], args["port"], time.monotonic() + args.get("ready_timeout", 60))
    result = asyncio.run(run(args))
    import lmcache

    result["lmcache_version"] = getattr(lmcache, "__version__", "unknown")
    result["torch_version"] = torch.__version__
    print("LMCACHE_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
