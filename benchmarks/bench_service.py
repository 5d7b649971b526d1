"""Service benchmark: Lookup+pin latency over gRPC and block bandwidth through the pool.

Starts a real server process (``python -m service``, as the e2e tests do) and
prints one JSON object. Baselines are measured in the same run, on the same
server and in the same process:

* **Lookup+pin of a long chain vs Ping.** A pinned Lookup of an N-block chain
  (precomputed hashes, and tokens) through the client SDK, then its Release,
  against a ``Ping`` whose payload is as large as that Lookup request, at
  concurrency 1 and 64 (asyncio tasks sharing one client and channel):
  median and p99 latency, ratio, throughput.
* **Store / load bandwidth vs numpy.** Storing N blocks (Reserve, copy into
  the mapped slots, Commit; the SDK store gets the chain as one array) and
  loading them (Lookup+pin, `Hit.copy_into` a destination array, Release),
  against a plain numpy copy of the same bytes, block by block, between two
  arrays of this process. These stores reuse slots stored into before
  (``reused_slot_store``).
* **First fill of a fresh node vs numpy.** ``--fresh-nodes`` times: start a
  node on its default arena size and budget (start-up: spawn to SERVING),
  `Client.register_namespace` (the RegisterNamespace RPC and mapping the
  pool), then the first `Client.store` of the chain into that new pool,
  against a numpy copy between pre-faulted arrays measured right after it
  (``first_fill_store``).

    python -m benchmarks.bench_service [--blocks 512] [--iterations 200] [--fresh-nodes 5] ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import google.protobuf
import grpc
import numpy as np
import numpy.typing as npt

from benchmarks._latency import TENANT, bench_latency, bench_uds, over_tcp_ping
from benchmarks._latency import lookup_tokens_sent as lookup_tokens_sent  # bench_scaling's
from benchmarks._server import ServerProcess
from benchmarks._stats import best_and_median, gbps
from kvstore.checksum import pack_checksums
from kvstore.client import Client, Namespace
from kvstore.client.blocks import copy_block_hashed
from kvstore.client.replies import reservation_from_proto
from kvstore.layout import KVLayout
from kvstore.types import BlockHash
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc

MiB = 1 << 20

META = (("x-kvstore-tenant", TENANT),)
"""Call metadata of the raw-stub calls: the client's tenant, who owns its lease."""


# --- bandwidth ---------------------------------------------------------------------


async def clear(stub: Any, ns: Namespace) -> None:
    await stub.Clear(pb.ClearRequest(namespace_id=ns.id), timeout=30, metadata=META)


async def store_phases(
    client: Client,
    stub: Any,
    ns: Namespace,
    chain: list[BlockHash],
    blocks: list[npt.NDArray[np.uint8]],
) -> dict[str, float]:
    """What `Client.store` does, phase by phase: Reserve RPC, copy into the slots, Commit RPC.

    The same packed wire forms, the same lease and the same `copy_block_hashed` the
    SDK uses, timed separately so the copy can be compared with numpy (block
    by block here; `Client.store` copies one run of adjacent slots at a time).
    """
    lease_id, _ = await client.lease.current()
    t0 = time.perf_counter()
    resp = await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns.id, lease_id=lease_id, packed_hashes=b"".join(chain)),
        timeout=30,
        metadata=META,
    )
    t1 = time.perf_counter()
    mapping = ns.mapping
    assert mapping is not None
    res = reservation_from_proto(resp)
    if len(res.reserved) != len(chain):
        raise RuntimeError(f"reserved {len(res.reserved)} of {len(chain)}; is the pool full?")
    # Each block hashed from its source right after its copy (a host pool's Commit
    # needs the writer's checksums).
    sums = [copy_block_hashed(blocks[i], mapping.buffer(res.slots[i])) for i in res.reserved]
    t2 = time.perf_counter()
    commit = await stub.Commit(
        pb.CommitRequest(
            namespace_id=ns.id,
            lease_id=lease_id,
            packed_hashes=res.packed_reserved(),
            packed_checksums=pack_checksums(sums),
        ),
        timeout=30,
        metadata=META,
    )
    t3 = time.perf_counter()
    if commit.committed != len(chain):
        raise RuntimeError(f"committed {commit.committed} of {len(chain)}")
    return {"reserve": t1 - t0, "copy": t2 - t1, "commit": t3 - t2, "total": t3 - t0}


async def load_phases(
    client: Client, ns: Namespace, chain: list[BlockHash], dst: npt.NDArray[np.uint8]
) -> dict[str, float]:
    """Lookup+pin, `Hit.copy_into` the destination array, Release; each phase timed."""
    t0 = time.perf_counter()
    hit = await client.lookup(ns, hashes=chain, pin=True)
    t1 = time.perf_counter()
    if hit.hit_blocks != len(chain):
        raise RuntimeError(f"expected a full hit, got {hit.hit_blocks}/{len(chain)}")
    hit.copy_into(dst)  # one copy per run of adjacent slots
    t2 = time.perf_counter()
    await client.release(hit)
    t3 = time.perf_counter()
    return {"lookup": t1 - t0, "copy": t2 - t1, "release": t3 - t2, "total": t3 - t0}


def numpy_copy(src: list[npt.NDArray[np.uint8]], dst: list[npt.NDArray[np.uint8]]) -> float:
    start = time.perf_counter()
    for target, block in zip(dst, src, strict=True):
        np.copyto(target, block)
    return time.perf_counter() - start


async def bench_bandwidth(
    client: Client, stub: Any, ns: Namespace, chain: list[BlockHash], args: Any
) -> dict[str, Any]:
    block_bytes = ns.block_bytes
    nbytes = block_bytes * len(chain)
    rng = np.random.default_rng(0)
    src_all = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    dst_all = np.empty(nbytes, dtype=np.uint8)
    dst_all.fill(1)  # fault every page in, as the server pre-faults its pool
    src = [src_all[i * block_bytes : (i + 1) * block_bytes] for i in range(len(chain))]
    dst = [dst_all[i * block_bytes : (i + 1) * block_bytes] for i in range(len(chain))]

    stores: list[dict[str, float]] = []
    sdk_stores: list[float] = []
    loads: list[dict[str, float]] = []
    baseline: list[float] = []
    for rep in range(args.repeats + 1):  # rep 0 warms up
        await clear(stub, ns)
        phases = await store_phases(client, stub, ns, chain, src)
        await clear(stub, ns)
        start = time.perf_counter()
        # The chain as one (n_blocks, block_bytes) array: one copy per run of slots.
        result = await client.store(ns, hashes=chain, blocks=src_all.reshape(len(chain), -1))
        sdk = time.perf_counter() - start
        if result.committed != len(chain):
            raise RuntimeError(f"SDK store committed {result.committed} of {len(chain)}")
        dst_all.fill(0)
        loaded = await load_phases(client, ns, chain, dst_all)
        if rep == 0 and not np.array_equal(dst_all, src_all):
            raise RuntimeError("loaded bytes differ from the stored bytes")
        copy = numpy_copy(src, dst)
        if rep:
            stores.append(phases)
            sdk_stores.append(sdk)
            loads.append(loaded)
            baseline.append(copy)

    numpy_best = min(baseline)
    numpy_median = statistics.median(baseline)
    store = best_and_median(stores, nbytes)
    load = best_and_median(loads, nbytes)
    store["sdk_store_ms"] = {
        "best": round(min(sdk_stores) * 1e3, 2),
        "median": round(statistics.median(sdk_stores) * 1e3, 2),
    }
    store["sdk_store_gbps_median"] = gbps(nbytes, statistics.median(sdk_stores))
    # Slots stored into before (cleared between runs): the pool's pages are in use already.
    store["sdk_store_time_over_numpy_median"] = round(
        statistics.median(sdk_stores) / numpy_median, 2
    )
    return {
        "blocks": len(chain),
        "bytes": nbytes,
        "repeats": args.repeats,
        "numpy_copy": {
            "best_ms": round(numpy_best * 1e3, 2),
            "median_ms": round(numpy_median * 1e3, 2),
            "gbps_best": gbps(nbytes, numpy_best),
            "gbps_median": gbps(nbytes, numpy_median),
        },
        "store": store,
        "load": load,
        "store_copy_time_over_numpy_median": round(
            statistics.median(r["copy"] for r in stores) / numpy_median, 2
        ),
        "load_copy_time_over_numpy_median": round(
            statistics.median(r["copy"] for r in loads) / numpy_median, 2
        ),
        "store_end_to_end_time_over_numpy_median": round(
            statistics.median(r["total"] for r in stores) / numpy_median, 2
        ),
        "load_end_to_end_time_over_numpy_median": round(
            statistics.median(r["total"] for r in loads) / numpy_median, 2
        ),
    }


# --- first fill ----------------------------------------------------------------------


async def first_fill_once(target: str, layout: KVLayout, n_blocks: int) -> dict[str, float]:
    """RegisterNamespace (and mapping) and the first store into the new pool, timed."""
    rng = np.random.default_rng(2)
    src_all = rng.integers(0, 256, size=(n_blocks, layout.block_bytes), dtype=np.uint8)
    async with Client(target, tenant=TENANT, timeout=60.0, lease_ttl=120.0) as client:
        await client.ping(b"")  # the channel and the lease are not what is measured
        await client.lease.current()
        t0 = time.perf_counter()
        ns = await client.register_namespace("bench-first-fill", layout)
        t1 = time.perf_counter()
        tokens = rng.integers(1, 128_000, size=n_blocks * layout.block_size).tolist()
        chain = ns.hash(tokens)
        t2 = time.perf_counter()
        result = await client.store(ns, hashes=chain, blocks=src_all)
        t3 = time.perf_counter()
        if result.committed != n_blocks:
            raise RuntimeError(f"first store committed {result.committed} of {n_blocks}")
    return {"register": t1 - t0, "store": t3 - t2}


def bench_first_fill(
    args: argparse.Namespace, layout: KVLayout, shm_dir: str | None
) -> dict[str, Any]:
    """Fresh nodes on their defaults: start-up, RegisterNamespace, first store vs numpy."""
    nbytes = layout.block_bytes * args.blocks
    rng = np.random.default_rng(0)
    src_all = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    dst_all = np.empty(nbytes, dtype=np.uint8)
    dst_all.fill(1)  # pre-faulted
    src = [
        src_all[i * layout.block_bytes : (i + 1) * layout.block_bytes] for i in range(args.blocks)
    ]
    dst = [
        dst_all[i * layout.block_bytes : (i + 1) * layout.block_bytes] for i in range(args.blocks)
    ]
    startups: list[float] = []
    registers: list[float] = []
    stores: list[float] = []
    baseline: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-fresh-", dir=shm_dir) as shm:
        for _ in range(args.fresh_nodes):
            start = time.perf_counter()
            server = ServerProcess.start(shm, capacity=args.fresh_capacity, prefix_stem="kvfresh")
            startups.append(time.perf_counter() - start)
            try:
                once = asyncio.run(first_fill_once(server.target, layout, args.blocks))
            finally:
                server.stop()
            registers.append(once["register"])
            stores.append(once["store"])
            baseline.append(numpy_copy(src, dst))
    numpy_median = statistics.median(baseline)
    store_median = statistics.median(stores)
    return {
        "nodes": args.fresh_nodes,
        "node_capacity": args.fresh_capacity,
        "bytes": nbytes,
        "node_startup_ms": _ms(startups),
        "register_namespace_ms": _ms(registers),
        "first_store_ms": _ms(stores),
        "numpy_copy_ms": _ms(baseline),
        "first_store_gbps_median": gbps(nbytes, store_median),
        "first_store_time_over_numpy_median": round(store_median / numpy_median, 2),
    }


def _ms(samples: list[float]) -> dict[str, float]:
    return {
        "best": round(min(samples) * 1e3, 2),
        "median": round(statistics.median(samples) * 1e3, 2),
        "worst": round(max(samples) * 1e3, 2),
    }


# --- main --------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "processor": platform.machine(),
        "python": sys.version.split()[0],
        "grpc": grpc.__version__,
        "protobuf": google.protobuf.__version__,
        "numpy": np.__version__,
    }


def layout_of(args: argparse.Namespace) -> KVLayout:
    """The KV layout the command line asks for."""
    return KVLayout(
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        dtype=args.dtype,
    )


async def run(
    args: argparse.Namespace, target: str, uds_target: str | None = None
) -> dict[str, Any]:
    layout = layout_of(args)
    pool_bytes = layout.block_bytes * args.blocks
    async with (
        Client(target, tenant=TENANT, timeout=60.0, lease_ttl=120.0) as client,
        grpc.aio.insecure_channel(target) as channel,
    ):
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        ns = await client.register_namespace("bench-service", layout, capacity_bytes=pool_bytes)
        if ns.capacity < args.blocks:
            raise RuntimeError(f"the pool holds {ns.capacity} blocks, {args.blocks} needed")
        rng = np.random.default_rng(1)
        tokens = rng.integers(1, 128_000, size=args.blocks * args.block_size).tolist()
        chain = ns.hash(tokens)
        if args.control_plane_only:  # store the chain once, untimed
            zeros = np.zeros(ns.block_bytes, dtype=np.uint8)
            await store_phases(client, stub, ns, chain, [zeros] * len(chain))
            bandwidth = None
        else:
            bandwidth = await bench_bandwidth(client, stub, ns, chain, args)
        # The chain is stored (READY) after the bandwidth runs: every lookup is a full hit.
        latency = await bench_latency(client, ns, tokens, chain, args)
        # A short chain: its first blocks (per-call costs, not per-block ones).
        short = min(args.short_blocks, len(chain))
        latency_short = await bench_latency(
            client, ns, tokens[: short * args.block_size], chain[:short], args
        )
        uds = await bench_uds(uds_target, layout, tokens, args) if uds_target else None
        stats = await client.stats()
    report: dict[str, Any] = {
        "layout": {
            "num_layers": layout.num_layers,
            "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim,
            "block_size": layout.block_size,
            "dtype": layout.dtype,
            "block_shape": list(layout.block_shape),
            "block_bytes": layout.block_bytes,
            "chain_blocks": args.blocks,
            "chain_tokens": len(tokens),
        },
        "lookup_vs_ping": latency,
        f"lookup_vs_ping_{short}_blocks": latency_short,
        **({"bandwidth": bandwidth} if bandwidth is not None else {}),
        "node_after": {
            "leases": stats.leases,
            "pinned": stats.pinned,
            "writing": stats.writing,
        },
    }
    if uds is not None:
        over_tcp_ping(uds, {k: report[k] for k in uds})
        report["uds"] = uds
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_service")
    parser.add_argument("--blocks", type=int, default=512, help="blocks per chain")
    parser.add_argument(
        "--short-blocks", type=int, default=32, help="blocks of the short chain's latency run"
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument(
        "--iterations", type=int, default=512, help="timed lookups (and pings) per concurrency"
    )
    parser.add_argument(
        "--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 64]
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed bandwidth runs")
    parser.add_argument(
        "--fresh-nodes", type=int, default=5, help="fresh nodes of the first-fill runs (0: none)"
    )
    parser.add_argument(
        "--fresh-capacity", default="1GiB", help="budget of the fresh nodes (the node's default)"
    )
    parser.add_argument("--shm-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument(
        "--control-plane-only",
        action="store_true",
        help="only the Lookup/Release vs Ping figures (no bandwidth, no fresh nodes)",
    )
    parser.add_argument(
        "--uds",
        action="store_true",
        help="also run the Lookup/Release figures over the node's Unix-domain socket",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    layout_bytes = (
        2 * args.layers * args.kv_heads * args.head_dim * args.block_size * 2 * args.blocks
    )
    capacity = f"{max(64 * MiB, 2 * layout_bytes) // MiB}MiB"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=args.shm_dir) as shm:
        # One arena for the whole budget: the pool is its full size from the start
        # (store_phases writes through the mapping it attached first).
        uds_path = os.path.join(shm, "kv.sock")
        extra = ("--arena-bytes", capacity) + (("--uds-path", uds_path) if args.uds else ())
        server = ServerProcess.start(
            shm, capacity=capacity, prefix_stem="kvbench", extra_args=extra
        )
        args.node_pid = server.process.pid  # its CPU time is read from /proc
        try:
            uds_target = f"unix:{uds_path}" if args.uds else None
            report = asyncio.run(run(args, server.target, uds_target))
        finally:
            status = server.stop()
        report["server_exit_status"] = status
    if args.fresh_nodes > 0 and not args.control_plane_only:
        first = bench_first_fill(args, layout_of(args), args.shm_dir)
        reused = report["bandwidth"]
        report["first_fill_vs_reused_store"] = {
            "first_fill_store": first,
            "reused_slot_store": {
                "sdk_store_ms": reused["store"]["sdk_store_ms"],
                "numpy_copy_ms": {
                    "best": reused["numpy_copy"]["best_ms"],
                    "median": reused["numpy_copy"]["median_ms"],
                },
                "sdk_store_time_over_numpy_median": reused["store"][
                    "sdk_store_time_over_numpy_median"
                ],
            },
        }
    report["machine"] = machine()
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
