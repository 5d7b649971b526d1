"""Redis benchmarks: directory publish and Locate, and the KV-bytes-in-Redis baseline.

Prints one JSON document:

- ``directory_publish_blocks_per_s``: blocks added to the directory through
  the agent's pipelined flushes (`Directory.write_changes`).
- ``locate_512``: latency of `Directory.locate` for a 512-block chain with
  three live holders (one Lua round trip), p50/p99 in ms.
- ``baseline``: store + load of the same blocks (a) as Redis SET/GET values
  (pipelined), as KV-cache layers that keep chunks in Redis do, and (b)
  through a node's shared-memory pool (Reserve, copy into the mapping,
  Commit; Lookup pinned, copy out of the mapping, Release) with the client
  SDK, in the same run; ``ratio`` = Redis time / pool time.

Starts its own redis-server on a free port (never 6379) and an in-process
node. ``python -m benchmarks.bench_redis [--blocks N] [--block-kib K]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid

import numpy as np
import redis.asyncio as aioredis

from kvstore.client import Client
from kvstore.layout import KVLayout
from kvstore.types import BlockHash, NamespaceId
from service.cluster.directory import Change, Directory, QueuedChange
from service.cluster.keys import Keys, member
from service.config import Config
from service.server import Server

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
"""tmpfs for the pool files (the default temp dir elsewhere)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn_redis(workdir: str) -> tuple[subprocess.Popen[bytes], int]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("bench_redis: needs redis-server on PATH")
    port = _free_port()
    return subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    ), port  # fmt: skip


async def _start_redis(workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    proc, port = _spawn_redis(workdir)
    url = f"redis://127.0.0.1:{port}/0"
    client = aioredis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            await client.ping()
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)
    await client.aclose()
    return proc, url


async def bench_directory(url: str, blocks: int) -> dict[str, object]:
    client = aioredis.Redis.from_url(url)
    keys = Keys("bench")
    ns = NamespaceId("0123456789abcdef")
    hashes = [BlockHash(secrets.token_bytes(32)) for _ in range(blocks)]
    writer = Directory(keys, "node-a", 60_000)
    batch = 20_000
    started = time.perf_counter()
    for start in range(0, blocks, batch):
        pipe = client.pipeline(transaction=False)
        members = tuple(member(h, "tenant") for h in hashes[start : start + batch])
        writer.write_changes(pipe, [QueuedChange(Change.ADD, ns, members)])
        await pipe.execute()
    publish_s = time.perf_counter() - started
    # Three live holders of a 512-block chain (full, 400, 100 blocks).
    chain = hashes[:512]
    for node_id, held in (("node-a", 512), ("node-b", 400), ("node-c", 100)):
        d = Directory(keys, node_id, 60_000)
        pipe = client.pipeline(transaction=False)
        d.write_changes(
            pipe, [QueuedChange(Change.ADD, ns, tuple(member(h, "tenant") for h in chain[:held]))]
        )
        await pipe.execute()
        await d.heartbeat(client, [ns], f"{node_id}:50051")
    reader = Directory(keys, "router", 60_000)
    for _ in range(20):  # warm up (script cache, connections)
        await reader.locate(client, ns, "tenant", chain)
    samples = []
    for _ in range(300):
        t = time.perf_counter()
        holders = await reader.locate(client, ns, "tenant", chain)
        samples.append((time.perf_counter() - t) * 1000)
    assert [h.blocks for h in holders] == [512, 400, 100], holders
    samples.sort()
    await client.aclose()
    return {
        "directory_publish_blocks_per_s": round(blocks / publish_s),
        "directory_publish_blocks": blocks,
        "locate_512": {
            "holders": 3,
            "p50_ms": round(statistics.median(samples), 3),
            "p99_ms": round(samples[int(len(samples) * 0.99) - 1], 3),
            "mean_ms": round(statistics.fmean(samples), 3),
        },
    }


async def bench_baseline(url: str, blocks: int, block_kib: int, shm_dir: str) -> dict[str, object]:
    # head_dim chosen so one block is block_kib KiB: 2 * layers * 16 tokens * heads * dim * 2 bytes.
    head_dim = block_kib * 1024 // (2 * 8 * 16 * 4 * 2)
    layout = KVLayout(
        num_layers=8, num_kv_heads=4, head_dim=head_dim, block_size=16, dtype="float16"
    )
    block_bytes = layout.block_bytes
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, block_bytes, dtype=np.uint8).tobytes() for _ in range(blocks)]
    tokens = [int(t) for t in rng.integers(0, 32000, blocks * layout.block_size)]

    client = aioredis.Redis.from_url(url)
    keys = [f"bench:kv:{i}" for i in range(blocks)]
    started = time.perf_counter()
    for start in range(0, blocks, 64):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(blocks, start + 64)):
            pipe.set(keys[i], data[i])
        await pipe.execute()
    redis_store = time.perf_counter() - started
    started = time.perf_counter()
    loaded: list[bytes] = []
    for start in range(0, blocks, 64):
        loaded.extend(await client.mget(keys[start : start + 64]))
    redis_load = time.perf_counter() - started
    assert loaded == data
    await client.aclose()

    config = Config(
        host="127.0.0.1", port=0, metrics_port=0, capacity_bytes=(blocks + 16) * block_bytes * 2,
        namespace_capacity_bytes=(blocks + 16) * block_bytes, arena_bytes=64 << 20,
        shm_dir=shm_dir, pool_prefix=f"bench{uuid.uuid4().hex[:6]}", pool_prefault=True,
        node_id="bench", salt_secret=bytes(range(32)), grace_seconds=0.1,
        max_message_bytes=64 << 20, max_chain_blocks=max(1024, blocks),
    )  # fmt: skip
    async with Server(config) as server, Client(server.address) as kv:
        ns = await kv.register_namespace("bench-model", layout)
        started = time.perf_counter()
        await kv.store(ns, tokens, data)
        pool_store = time.perf_counter() - started
        started = time.perf_counter()
        hit = await kv.lookup(ns, tokens, pin=True)
        out = [bytes(buf) for buf in hit.buffers()]
        await kv.release(hit)
        pool_load = time.perf_counter() - started
        assert out == data
    redis_total = redis_store + redis_load
    pool_total = pool_store + pool_load
    return {
        "blocks": blocks,
        "block_bytes": block_bytes,
        "redis_set_get": {"store_s": round(redis_store, 4), "load_s": round(redis_load, 4)},
        "node_shm_pool": {"store_s": round(pool_store, 4), "load_s": round(pool_load, 4)},
        "redis_gib_per_s": round(2 * blocks * block_bytes / redis_total / 2**30, 3),
        "pool_gib_per_s": round(2 * blocks * block_bytes / pool_total / 2**30, 3),
        "ratio_redis_over_pool": round(redis_total / pool_total, 2),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directory-blocks", type=int, default=100_000)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--block-kib", type=int, default=256)
    args = parser.parse_args()
    shm = SHM_DIR
    with tempfile.TemporaryDirectory() as workdir, tempfile.TemporaryDirectory(dir=shm) as shm_dir:
        proc, url = await _start_redis(workdir)
        try:
            result = {"benchmark": "bench_redis"}
            result.update(await bench_directory(url, args.directory_blocks))
            result["baseline"] = await bench_baseline(url, args.blocks, args.block_kib, shm_dir)
        finally:
            proc.terminate()
            proc.wait(10)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
