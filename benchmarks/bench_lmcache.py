"""kvstore vs what a user would pick instead: LMCache's own server and Redis, in one run.

Stores and loads the same blocks (512 x 256 KiB by default, the same random
bytes everywhere) through:

* ``kvstore_mapped``: a kvstore node process (`benchmarks/_server.py`) and the
  SDK with the pool mapped: `Client.store` (Reserve, copy into the slots,
  Commit) and Lookup+pin, `Hit.copy_into` a destination array, Release.
* ``kvstore_grpc``: the same node, a client with ``map_pool=False``: the store
  streams the bytes (``WriteBlocks``), the load streams them back
  (``ReadBlocks``) and copies them into the destination array.
* ``lmcache``: LMCache's legacy CPU server (``lmcache_server HOST PORT cpu``)
  and LMCache's own remote connector, run under LMCache's Python by
  `benchmarks/_lmcache_client.py` (see there for what is timed).
* ``redis``: pipelined SET, then MGET, 64 keys a round trip (as in
  `bench_redis`).
* ``numpy_copy``: the same bytes copied block by block between two arrays.

Prints one JSON object: per path the median (of ``--repeats``, default 3)
store and load seconds and GB/s, and time ratios against kvstore_mapped.

LMCache lives in its own venv (it needs its own torch); give its Python with
``--lmcache-python`` or ``KVSTORE_LMCACHE_PYTHON``. Without it (or if it cannot
import lmcache) the benchmark prints ``{"skipped": "<reason>"}`` and exits 0.

    python -m benchmarks.bench_lmcache [--lmcache-python PATH] [--blocks 512] [--repeats 3]
    python -m benchmarks.bench_lmcache --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import redis.asyncio as aioredis

from benchmarks._server import ServerProcess
from benchmarks._stats import gbps
from benchmarks.bench_redis import _free_port, _start_redis
from kvstore.client import Client, Namespace
from kvstore.layout import KVLayout
from kvstore.types import BlockHash
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc

MiB = 1 << 20
TENANT = "bench"
CLIENT_SCRIPT = Path(__file__).with_name("_lmcache_client.py")
MP_CLIENT_SCRIPT = Path(__file__).with_name("_lmcache_mp_client.py")
MP_CHUNK_TOKENS = 256
"""``lmcache server``'s default chunk: the MP runs store whole chunks only."""
MP_READY_LINE = "LMCache cache server is running"
"""What ``lmcache server`` logs once its ZMQ request server serves."""
ENV_PYTHON = "KVSTORE_LMCACHE_PYTHON"


def lmcache_python_problem(python: str | None) -> str | None:
    """Why LMCache cannot be measured with ``python`` (None: it can)."""
    if not python:
        return f"no LMCache python: pass --lmcache-python or set {ENV_PYTHON}"
    if not os.access(python, os.X_OK):
        return f"LMCache python {python!r} is not an executable"
    try:
        probe = subprocess.run(
            [python, "-c", "import lmcache.v1.server, lmcache.v1.storage_backend.connector"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "LMCACHE_DISABLE_BANNER": "1", "PYTHONPATH": ""},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"LMCache python {python!r} failed to run: {exc}"
    if probe.returncode != 0:
        return f"{python!r} cannot import lmcache: {probe.stderr.strip()[-300:]}"
    return None


# --- kvstore --------------------------------------------------------------------


async def _clear(client: Client, ns: Namespace) -> None:
    # The SDK has no Clear; the raw stub under the client's tenant, as bench_service does.
    async with grpc.aio.insecure_channel(client.target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        await stub.Clear(
            pb.ClearRequest(namespace_id=ns.id),
            timeout=30,
            metadata=(("x-kvstore-tenant", TENANT),),
        )


async def bench_kvstore(
    target: str, layout: KVLayout, src: npt.NDArray[np.uint8], repeats: int, mapped: bool
) -> list[dict[str, float]]:
    n = src.shape[0]
    dst = np.ones_like(src)
    runs = []
    async with Client(
        target, tenant=TENANT, timeout=60.0, lease_ttl=120.0, map_pool=mapped
    ) as client:
        ns = await client.register_namespace(
            "bench-lmcache", layout, capacity_bytes=n * layout.block_bytes
        )
        rng = np.random.default_rng(1)
        chain: list[BlockHash] = ns.hash(rng.integers(1, 128_000, size=n * layout.block_size))
        for rep in range(repeats + 1):  # rep 0 warms up
            await _clear(client, ns)
            t0 = time.perf_counter()
            # Mapped: one (n, block_bytes) array (one copy per run of slots); streamed: rows.
            blocks: Any = src if mapped else list(src)
            result = await client.store(ns, hashes=chain, blocks=blocks)
            t1 = time.perf_counter()
            if result.committed != n:
                raise RuntimeError(f"kvstore committed {result.committed} of {n}")
            dst.fill(0)
            t2 = time.perf_counter()
            hit = await client.lookup(ns, hashes=chain, pin=True)
            if hit.hit_blocks != n:
                raise RuntimeError(f"kvstore hit {hit.hit_blocks} of {n}")
            if mapped:
                hit.copy_into(dst)
            else:
                for i, data in enumerate(await client.read_blocks(hit)):
                    dst[i] = np.frombuffer(data, dtype=np.uint8)
            await client.release(hit)
            t3 = time.perf_counter()
            if rep == 0 and not np.array_equal(src, dst):
                raise RuntimeError("kvstore loaded other bytes than it stored")
            if rep:
                runs.append({"store": t1 - t0, "load": t3 - t2})
    return runs


# --- redis and numpy --------------------------------------------------------------


async def bench_redis(src: npt.NDArray[np.uint8], repeats: int) -> list[dict[str, float]]:
    n = src.shape[0]
    data = [src[i].tobytes() for i in range(n)]  # redis-py sends bytes
    keys = [f"bench:kv:{i}" for i in range(n)]
    runs = []
    with tempfile.TemporaryDirectory() as workdir:
        proc, url = await _start_redis(workdir)
        try:
            client = aioredis.Redis.from_url(url)
            for rep in range(repeats + 1):
                await client.flushdb()
                t0 = time.perf_counter()
                for start in range(0, n, 64):
                    pipe = client.pipeline(transaction=False)
                    for i in range(start, min(n, start + 64)):
                        pipe.set(keys[i], data[i])
                    await pipe.execute()
                t1 = time.perf_counter()
                loaded: list[Any] = []
                for start in range(0, n, 64):
                    loaded.extend(await client.mget(keys[start : start + 64]))
                t2 = time.perf_counter()
                if rep == 0 and loaded != data:
                    raise RuntimeError("redis loaded other bytes than it stored")
                if rep:
                    runs.append({"store": t1 - t0, "load": t2 - t1})
            await client.aclose()
        finally:
            proc.terminate()
            proc.wait(10)
    return runs


def bench_numpy(src: npt.NDArray[np.uint8], repeats: int) -> list[dict[str, float]]:
    dst = np.ones_like(src)
    runs = []
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        for i in range(src.shape[0]):
            np.copyto(dst[i], src[i])
        t1 = time.perf_counter()
        if rep:
            runs.append({"store": t1 - t0, "load": t1 - t0})
    return runs


# --- LMCache ------------------------------------------------------------------------


def bench_lmcache(
    python: str, data_path: Path, layout: KVLayout, n: int, repeats: int, workdir: Path
) -> dict[str, Any]:
    """LMCache's legacy CPU server and its remote connector, see `_lmcache_client`."""
    port = _free_port()
    log_path = workdir / "lmcache_server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [python, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_lmcache_env(),
        )  # fmt: skip
    try:
        args = {
            "host": "127.0.0.1",
            "port": port,
            "data": str(data_path),
            "blocks": n,
            "repeats": repeats,
            "layers": layout.num_layers,
            "tokens": layout.block_size,
            "heads": layout.num_kv_heads,
            "head_dim": layout.head_dim,
        }
        return _run_client(python, CLIENT_SCRIPT, args, log_path)
    finally:
        _stop(server)


def _lmcache_env() -> dict[str, str]:
    return {
        **os.environ,
        "LMCACHE_DISABLE_BANNER": "1",
        "LMCACHE_TRACK_USAGE": "false",
        "PYTHONPATH": "",
    }


def _run_client(python: str, script: Path, args: dict[str, Any], log_path: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [python, str(script), json.dumps(args)],
        capture_output=True, text=True, timeout=600, env=_lmcache_env(),
    )  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith("LMCACHE_RESULT "):
            result: dict[str, Any] = json.loads(line.split(" ", 1)[1])
            return result
    raise RuntimeError(
        f"LMCache client {script.name} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}\n"
        f"server log:\n{log_path.read_text(errors='replace')[-2000:]}"
    )


def _stop(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(10)


def bench_lmcache_mp(
    python: str, data_path: Path, layout: KVLayout, n: int, repeats: int, workdir: Path
) -> dict[str, dict[str, Any]]:
    """Both CPU transfer modes of ``lmcache server`` (one server), see `_lmcache_mp_client`."""
    port, http_port = _free_port(), _free_port()
    l1_gb = max(1, math.ceil(2 * (repeats + 1) * n * layout.block_bytes * 1.25 / 2**30))
    log_path = workdir / "lmcache_mp_server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [python, "-c", "from lmcache.cli.main import main; main()", "server",
             "--host", "127.0.0.1", "--port", str(port), "--http-host", "127.0.0.1",
             "--http-port", str(http_port), "--l1-size-gb", str(l1_gb),
             "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
             "--disable-observability"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_lmcache_env(),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while MP_READY_LINE not in log_path.read_text(errors="replace"):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"lmcache server not ready (exit {server.poll()}):\n"
                    + log_path.read_text(errors="replace")[-3000:]
                )
            time.sleep(0.2)
        out = {}
        for mode in ("lmcache_driven", "engine_driven"):
            args = {
                "port": port,
                "http_port": http_port,
                "transfer_mode": mode,
                "data": str(data_path),
                "blocks": n,
                "repeats": repeats,
                "layers": layout.num_layers,
                "tokens": layout.block_size,
                "heads": layout.num_kv_heads,
                "head_dim": layout.head_dim,
            }
            out[mode] = _run_client(python, MP_CLIENT_SCRIPT, args, log_path)
        return out
    finally:
        _stop(server)


# --- summary ------------------------------------------------------------------------


def summarise(runs: list[dict[str, float]], nbytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in runs[0]:
        median = statistics.median(r[phase] for r in runs)
        out[f"{phase}_ms_median"] = round(median * 1e3, 2)
        if phase in ("store", "load"):
            out[f"{phase}_gbps_median"] = gbps(nbytes, median)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_lmcache")
    parser.add_argument("--lmcache-python", default=os.environ.get(ENV_PYTHON))
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (median)")
    parser.add_argument("--quick", action="store_true", help="32 blocks, 1 repeat")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--shm-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    problem = lmcache_python_problem(args.lmcache_python)
    if problem is not None:
        print(json.dumps({"benchmark": "bench_lmcache", "skipped": problem}))
        return
    if args.quick:
        args.blocks, args.repeats = 32, 1
    if args.blocks * args.block_size % MP_CHUNK_TOKENS:
        build_parser().error(f"blocks x block size must fill {MP_CHUNK_TOKENS}-token chunks")
    layout = KVLayout(
        num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        block_size=args.block_size, dtype="float16",
    )  # fmt: skip
    n = args.blocks
    nbytes = n * layout.block_bytes
    src = np.random.default_rng(0).integers(0, 256, size=(n, layout.block_bytes), dtype=np.uint8)
    started = time.perf_counter()
    capacity = f"{max(64 * MiB, 2 * nbytes) // MiB}MiB"
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=args.shm_dir) as tmp:
        workdir = Path(tmp)
        data_path = workdir / "blocks.bin"
        src.tofile(data_path)
        runs: dict[str, list[dict[str, float]]] = {"numpy_copy": bench_numpy(src, args.repeats)}
        server = ServerProcess.start(
            workdir, capacity=capacity, prefix_stem="kvlmc", extra_args=("--arena-bytes", capacity)
        )
        try:
            for name, mapped in (("kvstore_mapped", True), ("kvstore_grpc", False)):
                runs[name] = asyncio.run(
                    bench_kvstore(server.target, layout, src, args.repeats, mapped)
                )
        finally:
            server_status = server.stop()
        runs["redis"] = asyncio.run(bench_redis(src, args.repeats))
        lmc = bench_lmcache(args.lmcache_python, data_path, layout, n, args.repeats, workdir)
        runs["lmcache_legacy_server"] = lmc.pop("runs")
        mp = bench_lmcache_mp(args.lmcache_python, data_path, layout, n, args.repeats, workdir)
        for mode, result in mp.items():
            runs[f"lmcache_mp_{mode}"] = result["runs"]
    report: dict[str, Any] = {
        "benchmark": "bench_lmcache",
        "blocks": n,
        "block_bytes": layout.block_bytes,
        "bytes": nbytes,
        "repeats": args.repeats,
        "lmcache_version": lmc.get("lmcache_version"),
        "lmcache_torch": lmc.get("torch_version"),
        "lmcache_mp_chunk_tokens": mp["lmcache_driven"].get("chunk_tokens"),
        "python": sys.version.split()[0],
    }
    for name, path_runs in runs.items():
        report[name] = summarise(path_runs, nbytes)
    base = report["kvstore_mapped"]
    report["time_over_kvstore_mapped"] = {
        name: {
            op: round(report[name][f"{op}_ms_median"] / base[f"{op}_ms_median"], 2)
            for op in ("store", "load")
        }
        for name in runs
        if name != "kvstore_mapped"
    }
    report["kvstore_server_exit_status"] = server_status
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
