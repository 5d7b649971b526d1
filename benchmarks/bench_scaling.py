"""Scaling benchmark: one node, 1-8 client processes, Lookup+Release pairs/s and node cores.

Starts one real node (``python -m service``, as bench_service does), registers
a namespace and stores one chain (512 blocks by default) once. Then, for each
number of client processes N (1, 2, 4, 8), the first N of a set of worker
processes (each with its own `kvstore.client.Client`, channel and lease, the
chain's hashes precomputed) run for a fixed time:

* ``lookup``: a pinned Lookup of the whole chain (always a full hit), then its
  Release, in a loop (``--tasks`` of them in flight per process);
* ``tokens``: the same, given the chain's tokens: the SDK hashes them in the
  client process and sends the chain (``--ops lookup,tokens,tokens_sent,ping``);
* ``tokens_sent``: the same, the tokens sent for the node to hash (what a
  client without the SDK does, and the SDK did before it hashed prompts);
* ``ping``: the baseline, the same processes echoing a ``Ping`` whose payload
  is as large as the Lookup request.

For each, it reports the calls per second of all processes together, the
node process's CPU use over the window (utime+stime from ``/proc/<pid>/stat``
before and after, so every thread of the node counts) in cores, and the
client processes' CPU in cores. Prints one JSON object.

    python -m benchmarks.bench_scaling [--blocks 512] [--clients 1,2,4,8] [--seconds 3]
        [--tasks 1] [--ops lookup,ping] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import grpc
import numpy as np

from benchmarks._server import ServerProcess
from benchmarks.bench_service import lookup_tokens_sent as lookup_tokens_sent_
from kvstore.client import Hit, ShardedClient
from kvstore.layout import KVLayout
from kvstore.types import BlockHash
from kvstore.v1 import kvstore_pb2 as pb

MiB = 1 << 20
OPS = ("lookup", "tokens", "tokens_sent", "ping")
"""What a round may measure (see the module docstring)."""
TENANT = "bench"
MODEL = "bench-scaling"
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat_cpu(stat: str) -> float:
    """utime + stime, in seconds, of a ``/proc/<pid>/stat`` line (fields 14 and 15)."""
    # The command name (field 2) may hold spaces and parentheses: split after the last ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process has used, all its threads together."""
    with open(f"/proc/{pid}/stat") as f:
        return stat_cpu(f.read())


def schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of a process's main thread."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            running, waiting, _ = f.read().split()
    except (OSError, ValueError):
        return 0.0, 0.0  # no schedstat in this kernel
    return int(running) / 1e9, int(waiting) / 1e9


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of a process: (name, utime+stime seconds), from ``/proc/<pid>/task``."""
    threads: dict[int, tuple[str, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        threads[int(tid)] = (name, stat_cpu(stat))
    return threads


def busy_threads(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall: float
) -> dict[str, float]:
    """Cores used per thread name over ``wall`` seconds (threads under 0.01 core left out)."""
    by_name: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        used = cpu - before.get(tid, (name, 0.0))[1]
        key = "main (event loop)" if tid == min(after) else name
        by_name[key] = by_name.get(key, 0.0) + used / wall
    return {k: round(v, 2) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]) if v >= 0.01}


def layout_of(args: argparse.Namespace) -> KVLayout:
    return KVLayout(
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        dtype=args.dtype,
    )


def lookup_request_bytes(namespace_id: str, chain: list[bytes]) -> int:
    """Size of the pinned Lookup request the SDK sends (its chain as ``packed_hashes``)."""
    request = pb.LookupRequest(
        namespace_id=namespace_id, lease_id=1, pin=True, packed_hashes=b"".join(chain)
    )
    return request.ByteSize()


def receive(conn: Connection, proc: Any, timeout: float) -> Any:
    """The next message of a worker; RuntimeError if it died or stayed silent too long."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} exited ({proc.exitcode}) or is silent")
    return conn.recv()


# --- worker processes ------------------------------------------------------------------


def worker(
    targets: list[str],
    layout: KVLayout,
    prompts: list[list[int]],
    chains: list[list[bytes]],
    conn: Connection,
) -> None:
    """One client process: connects, then runs the rounds the parent sends until ``None``."""
    asyncio.run(_worker(targets, layout, prompts, chains, conn))


async def _worker(
    targets: list[str],
    layout: KVLayout,
    prompts: list[list[int]],
    chains: list[list[bytes]],
    conn: Connection,
) -> None:
    # One node: a ShardedClient of one is a Client. Several: each chain on its node.
    async with ShardedClient(targets, tenant=TENANT, timeout=60.0, lease_ttl=300.0) as kv:
        ns = await kv.register_namespace(MODEL, layout)
        hashes = [[BlockHash(h) for h in chain] for chain in chains]
        size = lookup_request_bytes(ns.parts[0].id, chains[0])
        payload = os.urandom(size)
        turn = itertools.count(os.getpid())  # processes start on different chains

        async def released(hit: Hit, blocks: int) -> None:
            if hit.hit_blocks != blocks:
                raise RuntimeError(f"expected a full hit, got {hit.hit_blocks}/{blocks}")
            await kv.release(hit)

        async def lookup() -> None:
            chain = hashes[next(turn) % len(hashes)]
            await released(await kv.lookup(ns, hashes=chain, pin=True), len(chain))

        async def lookup_tokens() -> None:
            i = next(turn) % len(prompts)
            await released(await kv.lookup(ns, prompts[i], pin=True), len(chains[i]))

        async def lookup_tokens_sent() -> None:
            i = next(turn) % len(prompts)
            node = kv.shard_of(ns, hashes=chains[i]) or 0
            client = kv.clients[node]
            lease_id, generation = await client.lease.current()
            hit = await lookup_tokens_sent_(
                client, ns.parts[node], prompts[i], lease_id, generation
            )
            await released(hit, len(chains[i]))

        async def ping() -> None:
            if len(await kv.clients[0].ping(payload)) != len(payload):
                raise RuntimeError("Ping echoed another payload")

        ops = {
            "lookup": lookup,
            "tokens": lookup_tokens,
            "tokens_sent": lookup_tokens_sent,
            "ping": ping,
        }
        for op in ops.values():  # warm up every path (and the channels)
            for _ in range(3):
                await op()
        conn.send({"ready": True, "ping_payload_bytes": size})
        while True:
            command = await asyncio.to_thread(conn.recv)
            if command is None:
                return
            conn.send(await _round(ops[command["op"]], command))


async def _round(op: Any, command: dict[str, Any]) -> dict[str, Any]:
    """Run ``op`` in ``tasks`` loops until ``end``; count the calls done in [start, end)."""
    start, end = command["start"], command["end"]
    counted = 0
    cpu = 0.0

    async def loop() -> None:
        nonlocal counted
        while True:
            now = time.time()
            if now >= end:
                return
            await op()
            if now >= start and time.time() < end:
                counted += 1

    delay = start - time.time()
    if delay > 0:
        await asyncio.sleep(delay)
    cpu = time.process_time()
    await asyncio.gather(*(loop() for _ in range(command["tasks"])))
    return {"calls": counted, "cpu_s": time.process_time() - cpu}


# --- the parent ------------------------------------------------------------------------


async def setup(
    targets: list[str], layout: KVLayout, blocks: int, count: int
) -> tuple[list[list[int]], list[list[bytes]]]:
    """Register the namespace and store ``count`` chains of ``blocks`` blocks; tokens, hashes."""
    async with ShardedClient(targets, tenant=TENANT, timeout=60.0) as kv:
        ns = await kv.register_namespace(
            MODEL, layout, capacity_bytes=layout.block_bytes * blocks * count
        )
        rng = np.random.default_rng(1)
        prompts: list[list[int]] = []
        chains: list[list[bytes]] = []
        data = rng.integers(0, 256, size=(blocks, layout.block_bytes), dtype=np.uint8)
        for _ in range(count):
            tokens = rng.integers(1, 128_000, size=blocks * layout.block_size).tolist()
            stored = await kv.store(ns, tokens, data)
            if stored.committed != blocks:
                raise RuntimeError(f"stored {stored.committed} of {blocks} blocks; pool full?")
            prompts.append(tokens)
            chains.append([bytes(h) for h in stored.chain])
        return prompts, chains


def measure(
    pipes: list[Connection],
    procs: list[Any],
    node_pids: list[int],
    op: str,
    n: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One round: ``op`` on the first ``n`` workers for ``args.seconds``."""
    start = time.time() + 0.3  # every worker has its command by then
    end = start + args.seconds
    for conn in pipes[:n]:
        conn.send({"op": op, "start": start, "end": end, "tasks": args.tasks})
    time.sleep(max(0.0, start - time.time()))
    node_pid = node_pids[0] if node_pids else None  # threads and loop: the first node's
    node_cpu = sum(cpu_seconds(pid) for pid in node_pids)
    threads = thread_cpu(node_pid) if node_pid else {}
    sched = schedstat(node_pid) if node_pid else (0.0, 0.0)
    wall = time.time()
    time.sleep(max(0.0, end - time.time()))
    node_cpu = sum(cpu_seconds(pid) for pid in node_pids) - node_cpu
    threads_after = thread_cpu(node_pid) if node_pid else {}
    sched_after = schedstat(node_pid) if node_pid else (0.0, 0.0)
    wall = time.time() - wall
    results = [receive(conn, proc, 60.0) for conn, proc in zip(pipes, procs[:n], strict=False)]
    calls = sum(r["calls"] for r in results)
    return {
        "clients": n,
        "calls": calls,
        "per_s": round(calls / args.seconds, 1),
        "node_cores": round(node_cpu / wall, 2) if node_pids else None,
        "node_threads": busy_threads(threads, threads_after, wall),
        # The event loop's thread: share of the window it ran, and it ran or waited
        # for a CPU (1.0 = saturated: it would use a whole core if one were free).
        "loop_running": round((sched_after[0] - sched[0]) / wall, 2),
        "loop_running_or_runnable": round(
            (sched_after[0] + sched_after[1] - sched[0] - sched[1]) / wall, 2
        ),
        "client_cores": round(sum(r["cpu_s"] for r in results) / args.seconds, 2),
    }


def run(args: argparse.Namespace, targets: list[str], node_pids: list[int]) -> dict[str, Any]:
    layout = layout_of(args)
    prompts, chains = asyncio.run(setup(targets, layout, args.blocks, args.chains))
    ctx = mp.get_context("spawn")  # no fork of a process that has used grpc
    pipes: list[Connection] = []
    procs: list[Any] = []
    for i in range(max(args.clients)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=worker, args=(targets, layout, prompts, chains, child), name=f"client-{i}"
        )
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    try:
        ready = [receive(conn, proc, 120.0) for conn, proc in zip(pipes, procs, strict=True)]
        curves: dict[str, list[dict[str, Any]]] = {op: [] for op in OPS}
        for n in args.clients:
            for op in args.ops:
                curves[op].append(measure(pipes, procs, node_pids, op, n, args))
    finally:
        for conn in pipes:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    report: dict[str, Any] = {
        "nodes": len(targets),
        "chains": args.chains,
        "blocks": args.blocks,
        "block_bytes": layout.block_bytes,
        "seconds_per_point": args.seconds,
        "tasks_per_client": args.tasks,
        "ping_payload_bytes": ready[0]["ping_payload_bytes"],
        "lookup_release_pairs": curves["lookup"],
        "ping": curves["ping"],
        "lookup_over_ping": [
            round(lk["per_s"] / pg["per_s"], 3) if pg["per_s"] else None
            for lk, pg in zip(curves["lookup"], curves["ping"], strict=False)
        ],
    }
    for op in ("tokens", "tokens_sent"):
        if curves[op]:
            report[f"{op}_lookup_release_pairs"] = curves[op]
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_scaling")
    parser.add_argument("--blocks", type=int, default=512, help="blocks of the chain")
    parser.add_argument(
        "--clients", type=lambda s: [int(c) for c in s.split(",")], default=[1, 2, 4, 8]
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="measured time per point")
    parser.add_argument(
        "--ops",
        type=lambda s: s.split(","),
        default=["lookup", "ping"],
        help=f"what to measure, of {', '.join(OPS)} (one alone: to profile it)",
    )
    parser.add_argument("--tasks", type=int, default=1, help="calls in flight per process")
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="nodes to start; clients use them as one cache (ShardedClient)",
    )
    parser.add_argument(
        "--chains",
        type=int,
        default=1,
        help="chains stored, looked up in turn (more than one to spread them over --nodes)",
    )
    # A small block: lookups never touch the bytes, and the pool stays small.
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--quick", action="store_true", help="1 s per point, clients 1,2,4")
    parser.add_argument(
        "--target",
        help="measure this running node (host:port; several, comma-separated, as one"
        " ShardedClient) instead of starting one (e.g. a node under a profiler)",
    )
    parser.add_argument("--node-pid", type=int, help="with --target: the node's pid (for its CPU)")
    parser.add_argument("--shm-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    return parser


def start_and_run(args: argparse.Namespace) -> dict[str, Any]:
    """Start ``--nodes`` nodes (each one arena as big as its budget), run, stop them."""
    layout = layout_of(args)
    per_node = 2 * layout.block_bytes * args.blocks * args.chains
    capacity = f"{max(64 * MiB, per_node) // MiB + 1}MiB"
    with contextlib.ExitStack() as stack:
        servers = []
        for i in range(args.nodes):
            shm = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=args.shm_dir)
            )
            server = ServerProcess.start(
                shm,
                capacity=capacity,
                prefix_stem=f"kvscale{i}",
                extra_args=("--arena-bytes", capacity),
            )
            stack.callback(server.stop)
            servers.append(server)
        report = run(args, [s.target for s in servers], [s.process.pid for s in servers])
    report["server_exit_status"] = [s.exit_code for s in servers]
    return report


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if unknown := [op for op in args.ops if op not in OPS]:
        parser.error(f"unknown --ops {', '.join(unknown)}; choose from {', '.join(OPS)}")
    if args.quick:
        args.seconds = 1.0
        args.clients = [n for n in args.clients if n <= 4]
    started = time.perf_counter()
    if args.target:
        report = run(args, args.target.split(","), [args.node_pid] if args.node_pid else [])
    else:
        report = start_and_run(args)
    report["machine"] = {
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "grpc": grpc.__version__,
    }
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
