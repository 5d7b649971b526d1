"""Soak: a bounded multi-process load on one node, every block read verified byte for byte.

    python -m benchmarks.soak --duration 300 --runners 6 --chat-runners 1 [--kill-every 10]

Starts a node (`benchmarks._server`), ``--runners`` synthetic runner
processes and ``--chat-runners`` processes of ``examples/chat_runner.py`` (a
small random Llama through `CachedPrefill`, which checks that cached logits
equal the uncached ones). A synthetic runner loops over prompts made of a
few shared system prompts and user prompts (shared or unique): a pinned
lookup, every hit block compared with `tests.e2e.workload.expected_block`
of its hash through the runner's own mapping, release, then a store of the
missing blocks; it reports its counters and per-operation latencies once a
second on stdout. With ``--kill-every S`` a random synthetic runner is
SIGKILLed every S seconds and replaced. Chat runners are restarted with a
new seed until the time is up.

At the end (runners gone, dead leases expired) the node must hold no lease,
pin or WRITING slot, account for every slot, and every READY block of the
synthetic namespace must hold its exact bytes. One JSON object on stdout:
ops/s, p50/p99 latency per operation, hit rate in tokens, corruptions,
leaks, kills. Exit status 1 when anything was corrupt or leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LEASE_TTL = 2.0
REPORT_EVERY = 1.0


# --- the synthetic runner (a child process) -------------------------------------------


async def _runner(target: str, seed: int, duration: float) -> None:
    import numpy as np

    from kvstore.client import Client
    from tests.e2e.workload import LAYOUT, MODEL_ID, expected_block, system_prompt, tokens

    rng = random.Random(f"soak/{seed}")
    systems = [system_prompt(f"soak/{k}", 72) for k in range(4)]
    counts: dict[str, int] = defaultdict(int)
    lat: dict[str, list[float]] = defaultdict(list)
    last = time.monotonic()

    def flush() -> None:
        print(json.dumps({"counts": counts, "lat": lat}), flush=True)
        counts.clear()
        lat.clear()

    async with Client(target, lease_ttl=LEASE_TTL, timeout=10.0, client_name="soak") as client:
        ns = await client.register_namespace(MODEL_ID, LAYOUT, capacity_bytes=2048 * 4096)
        deadline = time.monotonic() + duration
        n = 0
        while time.monotonic() < deadline:
            n += 1
            if rng.random() < 0.6:
                user = tokens(f"soak-user/{rng.randrange(40)}", 56)
            else:
                user = tokens(f"soak/{seed}/{n}", rng.randrange(8, 90))
            prompt = rng.choice(systems) + user
            chain = ns.hash(prompt)
            t0 = time.perf_counter()
            hit = await client.lookup(ns, hashes=chain, pin=True)
            t1 = time.perf_counter()
            views = hit.numpy_views()
            for loc, view, want in zip(hit.blocks, views, chain, strict=False):
                raw = view.reshape(-1).view(np.uint8)
                if loc.hash != want or not np.array_equal(raw, expected_block(loc.hash)):
                    counts["corrupt_blocks"] += 1
                counts["verified_blocks"] += 1
            del views
            t2 = time.perf_counter()
            await client.release(hit)
            t3 = time.perf_counter()
            result = await client.store(
                ns, hashes=chain, blocks=lambda i, c=chain: expected_block(c[i])
            )
            t4 = time.perf_counter()
            lat["lookup"].append(t1 - t0)
            lat["release"].append(t3 - t2)
            lat["store"].append(t4 - t3)
            counts["ops"] += 3
            counts["requests"] += 1
            counts["query_tokens"] += hit.query_tokens
            counts["hit_tokens"] += hit.hit_tokens
            counts["stored_blocks"] += result.committed
            counts["no_room"] += result.no_room
            if time.monotonic() - last >= REPORT_EVERY:
                flush()
                last = time.monotonic()
    flush()


# --- the node-side checks at the end ----------------------------------------------------


async def _final_check(target: str) -> dict[str, Any]:
    import grpc

    from kvstore.client import Client
    from kvstore.v1 import kvstore_pb2 as pb
    from kvstore.v1 import kvstore_pb2_grpc
    from tests.e2e.workload import LAYOUT, MODEL_ID, verify_ready_blocks

    deadline = time.monotonic() + LEASE_TTL + 15
    async with grpc.aio.insecure_channel(target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        while True:  # killed runners' leases expire one TTL after their death
            stats = await stub.Stats(pb.StatsRequest(), timeout=5)
            if stats.leases == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    leaks = {"leases": stats.leases, "pinned": stats.pinned, "writing": stats.writing}
    unaccounted = sum(
        abs(ns.capacity - ns.free - ns.quarantined - ns.ready - ns.writing)
        for ns in stats.namespaces
    )
    async with Client(target, client_name="soak-verifier") as client:
        ns = await client.register_namespace(MODEL_ID, LAYOUT)
        ready, corrupt = await verify_ready_blocks(target, ns)
    return {
        "leaks": leaks,
        "unaccounted_slots": unaccounted,
        "ready_blocks_verified": ready,
        "ready_blocks_corrupt": corrupt,
        "lease_expiries": stats.leases_expired,
    }


# --- the driver ---------------------------------------------------------------------------


class Child:
    """A runner process whose JSON lines are collected by a thread."""

    def __init__(
        self,
        argv: list[str],
        sink: list[dict[str, Any]],
        lock: threading.Lock,
        *,
        whole: bool = False,
    ) -> None:
        """Start ``argv``; its JSON lines (or, with ``whole``, its whole stdout) go to ``sink``."""
        self.whole = whole
        self.process = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        self.stderr = ""
        self._thread = threading.Thread(target=self._pump, args=(sink, lock), daemon=True)
        self._thread.start()
        self._err = threading.Thread(target=self._pump_err, daemon=True)
        self._err.start()

    def _pump(self, sink: list[dict[str, Any]], lock: threading.Lock) -> None:
        assert self.process.stdout is not None
        if self.whole:  # one indented JSON document (examples/chat_runner.py)
            text = self.process.stdout.read()
            try:
                with lock:
                    sink.append(json.loads(text))
            except json.JSONDecodeError:
                pass
            return
        for line in self.process.stdout:
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            with lock:
                sink.append(doc)

    def _pump_err(self) -> None:
        assert self.process.stderr is not None
        self.stderr = self.process.stderr.read()

    def join(self, timeout: float) -> int:
        code = self.process.wait(timeout)
        self._thread.join(5)
        self._err.join(5)
        return code


def _chat_outcome(code: int, stderr: str) -> tuple[int, int]:
    """(logit mismatch, other error) of a finished chat runner: it exits 1 on a mismatch."""
    if code == 0:
        return 0, 0
    return (0, 1) if "Traceback" in stderr else (1, 0)


def _percentiles(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {}
    ordered = sorted(samples)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"count": len(ordered), "p50_ms": at(0.50), "p99_ms": at(0.99), "max_ms": at(1.0)}


def soak(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks._server import ServerProcess

    lines: list[dict[str, Any]] = []
    chat_lines: list[dict[str, Any]] = []
    lock = threading.Lock()
    rng = random.Random(args.seed)
    kills = 0
    chat_runs = chat_failures = chat_errors = 0
    runner_failures: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvstore-soak-", dir=_shm()) as shm,
        ServerProcess.start(shm, capacity=args.capacity, prefix_stem="kvsoak") as server,
    ):
        started = time.monotonic()
        end = started + args.duration

        def runner(seed: int) -> Child:
            remaining = max(end - time.monotonic(), 0.5)
            argv = [sys.executable, "-m", "benchmarks.soak", "--run-runner",
                    "--target", server.target, "--seed", str(seed),
                    "--duration", f"{remaining:.2f}"]  # fmt: skip
            return Child(argv, lines, lock)

        def chat(seed: int) -> Child:
            # Always seed 0: the same random model (one namespace) and workload, so a
            # rerun hits what earlier runs stored. Another seed is another model.
            del seed
            argv = [sys.executable, str(ROOT / "examples" / "chat_runner.py"), "--target",
                    server.target, "--requests", str(args.chat_requests), "--seed", "0",
                    "--capacity-bytes", str(32 << 20),
                    "--system-tokens", "128", "--layers", "2", "--hidden", "128",
                    "--threads", "1"]  # fmt: skip
            return Child(argv, chat_lines, lock, whole=True)

        runners = [runner(1000 + i) for i in range(args.runners)]
        chats = [chat(i) for i in range(args.chat_runners)]
        next_seed = 2000
        next_kill = started + args.kill_every if args.kill_every else float("inf")
        while time.monotonic() < end:
            time.sleep(0.05)
            now = time.monotonic()
            if now >= next_kill and end - now > 2.0:
                victim = rng.randrange(len(runners))
                runners[victim].process.send_signal(signal.SIGKILL)
                runners[victim].join(10)
                kills += 1
                runners[victim] = runner(next_seed)
                next_seed += 1
                next_kill = now + args.kill_every
            for i, child in enumerate(chats):
                if child.process.poll() is not None:
                    chat_runs += 1
                    mismatch, error = _chat_outcome(child.join(10), child.stderr)
                    chat_failures += mismatch
                    chat_errors += error
                    if mismatch or error:
                        runner_failures.append(child.stderr[-2000:])
                    if end - time.monotonic() > 20:
                        chats[i] = chat(next_seed)
                        next_seed += 1
                    else:
                        chats[i] = None  # type: ignore[call-overload]
            chats = [c for c in chats if c is not None]
        for child in runners:
            if child.join(60) != 0:
                runner_failures.append(child.stderr[-2000:])
        for child in chats:
            chat_runs += 1
            mismatch, error = _chat_outcome(child.join(300), child.stderr)
            chat_failures += mismatch
            chat_errors += error
            if mismatch or error:
                runner_failures.append(child.stderr[-2000:])
        elapsed = time.monotonic() - started
        final = asyncio.run(_final_check(server.target))
        server_log = server.log_tail(2000)

    totals: dict[str, int] = defaultdict(int)
    lat: dict[str, list[float]] = defaultdict(list)
    for doc in lines:
        for key, value in doc["counts"].items():
            totals[key] += value
        for key, values in doc["lat"].items():
            lat[key].extend(values)
    chat_summaries = [doc for doc in chat_lines if "hit_rate_tokens" in doc]
    chat_prompt = sum(d["prompt_tokens"] for d in chat_summaries)
    chat_hit = sum(d["hit_tokens"] for d in chat_summaries)
    corrupt = totals["corrupt_blocks"] + final["ready_blocks_corrupt"] + chat_failures
    leaked = sum(final["leaks"].values()) + final["unaccounted_slots"]
    report = {
        "duration_s": round(elapsed, 1),
        "runners": args.runners,
        "chat_runners": args.chat_runners,
        "ops": totals["ops"],
        "ops_per_s": round(totals["ops"] / elapsed, 1),
        "requests": totals["requests"],
        "latency": {op: _percentiles(samples) for op, samples in sorted(lat.items())},
        "hit_rate_tokens": round(totals["hit_tokens"] / max(totals["query_tokens"], 1), 4),
        "verified_blocks": totals["verified_blocks"],
        "stored_blocks": totals["stored_blocks"],
        "no_room": totals["no_room"],
        "chat": {
            "runs": chat_runs,
            "requests": sum(d["requests"] for d in chat_summaries),
            "hit_rate_tokens": round(chat_hit / chat_prompt, 4) if chat_prompt else None,
            "logit_mismatch_runs": chat_failures,
            "error_runs": chat_errors,
        },
        "kills": kills,
        "corruptions": corrupt,
        "leaks": leaked,
        "final": final,
        "runner_failures": len(runner_failures),
    }
    if runner_failures:
        report["failure_tails"] = runner_failures[:3]
        report["server_log_tail"] = server_log
    return report


def _shm() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    p.add_argument("--runners", type=int, default=6, help="synthetic runner processes")
    p.add_argument("--chat-runners", type=int, default=1, help="examples/chat_runner.py processes")
    p.add_argument("--chat-requests", type=int, default=12, help="requests per chat runner run")
    p.add_argument("--kill-every", type=float, default=0.0, help="SIGKILL a runner every S s")
    p.add_argument("--capacity", default="256MiB", help="the node's memory budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-runner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_runner:
        asyncio.run(_runner(args.target, args.seed, args.duration))
        return 0
    report = soak(args)
    print(json.dumps(report, indent=2, sort_keys=True))
    return 1 if report["corruptions"] or report["leaks"] or report["runner_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
