"""vLLM time to first token with a long shared system prompt: cold, warm from kvstore,
and vLLM's own in-process prefix-cache hit (the limit), in one run.

    KVSTORE_VLLM_PYTHON=... python -m benchmarks.bench_vllm [--lengths 1024,2048,4096,8192]
        [--layers 6 --hidden 768] [--repeats 3] [--settle 2] [--quick] [--cluster]
        [--verify-checksums peer|all] [--disk] [--max-tokens 1] [--family gemma3,sliding,mla]

Makes a random Llama offline (float32), starts a cache node and two vLLM
engines with the kvstore connector (`tests/integrations/vllm/driver.py`):

- ``cold``: engine A, its prefix cache emptied, a system prompt nobody cached;
- ``kvstore``: engine B, its prefix cache emptied, the system prompt A stored;
- ``local``: engine A again on the same system prompt: vLLM's own prefix-cache hit.

With ``--cluster`` the engines are on two hosts: two nodes share a private
redis-server, A saves into node 1 and B looks up node 2, so B's first request
(``remote``) fetches the system prompt from node 1 (peer fetch) before loading
it, and B's second (``kvstore``, its prefix cache emptied again) loads it from
its own node, where the fetch left it (`docs/cluster.md`).

With ``--disk`` the node has a disk tier (a file in the run's temp folder) and a
third engine without the connector (``R``) is the reference. Per repeat, after
``cold``, B loads the system prompt from memory (``kvstore``), R computes the
same prompt from scratch (``reference``: recompute without the connector) and
again from its own prefix cache (``reference_local``); then the node is stopped
cleanly (which flushes the tier's write-behind) and started on the same disk
file with empty memory, so the prefix is only on disk, and B loads the same
prompt again (``disk``): the lookup promotes the blocks from disk. Per length
the JSON adds ``exact`` (B's outputs from memory and from disk against R's:
tokens equal, largest logprob difference, and R's own prefix-cache hit's
difference as the yardstick) and ``node_disk``, the restarted node's /metrics
deltas around the disk request (blocks promoted, promotion seconds).

With ``--family`` each model family named (a Gemma-3-style hybrid, an
all-sliding-window model, MLA) is measured instead: `bench_vllm_family`.

Each request is the system prompt plus a 16-token user prompt and
``--max-tokens`` generated tokens (1 by default). Prints one JSON object: per
length, the median time to first token (vLLM's ``first_token_latency``) and
the request's wall time, and the ratios the goals are stated in (kvstore /
local, cold / kvstore; with ``--cluster`` also cold / remote and remote /
kvstore; with ``--disk`` disk / kvstore, cold / disk, reference / disk).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.integrations.vllm.engines import Engine, Node, published, vllm_python
from tests.integrations.vllm.models import make_llama
from tests.redis.server import RedisServer


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


MAX_TOKENS = 1
"""Tokens each measured request generates (``--max-tokens``)."""


def one(engine: Engine, tokens: list[int], *, cold: bool, settle: float = 0.0) -> dict[str, Any]:
    if cold:
        engine.command(reset_prefix_cache=True)
    # After a request, vLLM's processes busy-wait (its shared-memory queues poll for
    # 1 s, OpenMP threads spin): on a small host the engine that ran last would slow
    # the next measured request down. Let every engine go idle first.
    time.sleep(settle)
    answer = engine.generate([tokens], max_tokens=MAX_TOKENS)
    counts = ("external_hits", "kvstore_loaded", "kvstore_load_errors")
    return {**answer["results"][0], **{k: answer[k] for k in counts}}


def start_node(
    workdir: Path, redis: RedisServer | None, verify: str = "peer", disk: tuple[str, ...] = ()
) -> Node:
    """A node with a 1 GiB namespace; in the cluster on ``redis`` when given; ``verify``:
    its ``verify_checksums`` ("all": every local load's bytes are checked too); ``disk``:
    more flags (the disk tier's)."""
    workdir.mkdir(parents=True, exist_ok=True)
    flags: tuple[str, ...] = ("--verify-checksums", verify, *disk)
    if redis is not None:
        flags += (
            "--redis-url", redis.url, "--node-id", workdir.name, "--cluster-token", "bench",
            "--heartbeat-seconds", "0.5", "--directory-flush-seconds", "0.01",
        )  # fmt: skip
    return Node(workdir, namespace_capacity="1GiB", extra_args=flags).start()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def disk_metrics(port: int) -> dict[str, float]:
    """The node's ``kvstore_disk_*`` samples on /metrics (labels kept in the name)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        page = resp.read().decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^(kvstore_disk_\S+) (\S+)$", page, re.M)
        if not m.group(1).endswith("_created")
    }


DISK_DELTAS = {
    "promoted_blocks": "kvstore_disk_hits_total",
    "reads": "kvstore_disk_reads_total",
    "promotions": "kvstore_disk_promotion_seconds_count",
    "promotion_s": "kvstore_disk_promotion_seconds_sum",
    "promotion_timeouts": "kvstore_disk_promotion_timeouts_total",
}


def wait_written(node: Node, at_least: int, timeout: float = 60) -> int:
    """Wait until the node's disk tier has written ``at_least`` blocks (its write-behind
    runs after the commits); returns the count, short of ``at_least`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (written := int(node.stats().disk.written_blocks)) < at_least:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return written


def reconnect(a: Engine, b: Engine, timeout: float = 120) -> int:
    """After a node restart, until B loads a prompt A just stored: A stores a prompt (its
    connector meets the new node), B, which only loads, asks for it. Returns the attempts
    (more than one while B's connector still waits out its ``retry_interval``).

    B computes nothing of its own first: its worker must follow the new pool epoch from a
    load alone (`Client.follow_epoch`; before that fix it kept the old pool mapping and
    every load failed until B happened to save a block: benchmarks/README.md).
    """
    deadline = time.monotonic() + timeout
    attempts = 0
    while True:
        attempts += 1
        warm = prompt(600_000 + attempts, 256)
        one(a, warm, cold=True)
        time.sleep(1.5)
        if one(b, warm, cold=True)["kvstore_loaded"] > 0:
            return attempts
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engines did not reach the restarted node in {timeout} s")
        time.sleep(1.0)


def exactness(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    return {
        "tokens_equal": got["tokens"] == ref["tokens"],
        "max_logprob_diff": max(
            abs(p - q) for p, q in zip(got["logprobs"], ref["logprobs"], strict=True)
        ),
    }


def wait_published(redis: RedisServer, node_id: str, at_least: int, timeout: float = 60) -> int:
    """Wait until the directory lists ``at_least`` blocks of ``node_id`` (saves and directory
    writes run in the background); returns the count."""
    deadline = time.monotonic() + timeout
    while (count := published(redis.url, node_id)) < at_least:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{node_id} did not publish {at_least} blocks in {timeout} s")
        time.sleep(0.02)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument(
        "--settle", type=float, default=2.0, help="idle seconds before each measured request"
    )
    parser.add_argument(
        "--quick", action="store_true", help="one 1k-token prompt on a 2-layer model (smoke run)"
    )
    parser.add_argument(
        "--cluster", action="store_true", help="engines on two nodes sharing a Redis directory"
    )
    parser.add_argument(
        "--verify-checksums",
        choices=("peer", "all"),
        default="all",
        help="the nodes' verify_checksums: 'all' (the node's default) checks every local "
        "load's bytes too; 'peer' only what crosses a host or a tier",
    )
    parser.add_argument(
        "--disk",
        action="store_true",
        help="a disk tier too: loads of a prefix only on disk (node restarted), and a "
        "reference engine without the connector",
    )
    parser.add_argument("--disk-capacity", default="2GiB", help="the disk tier's size (--disk)")
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens each request generates")
    parser.add_argument(
        "--family",
        default="",
        help="model families instead of the Llama (comma-separated: gemma3, sliding, mla; "
        "benchmarks/bench_vllm_family.py)",
    )
    args = parser.parse_args(argv)
    if args.family:
        return run_families(args)
    if args.quick:
        args.lengths, args.repeats, args.layers, args.hidden = "1024", 1, 2, 256
    if args.disk and args.cluster:
        parser.error("--disk runs on one node: leave out --cluster")
    global MAX_TOKENS
    MAX_TOKENS = args.max_tokens
    python = vllm_python()
    if python is None:
        print(json.dumps({"error": "no python with vLLM (set KVSTORE_VLLM_PYTHON)"}))
        return 2
    lengths = [int(x) for x in args.lengths.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = make_llama(
        work / "model", layers=args.layers, hidden=args.hidden, heads=args.hidden // 64,
        kv_heads=max(1, args.hidden // 256), max_positions=max(lengths) + 256,
    )  # fmt: skip
    redis = RedisServer(work / "redis").start() if args.cluster else None
    metrics_port = free_port() if args.disk else 0
    disk = (
        ("--disk-path", str(work / "kvstore.disk"), "--disk-capacity-bytes", args.disk_capacity,
         "--metrics-port", str(metrics_port))
        if args.disk else ()
    )  # fmt: skip
    nodes = [
        start_node(work / name, redis, args.verify_checksums, disk)
        for name in (("host-1", "host-2") if redis else ("n",))
    ]
    spec: dict[str, Any] = {
        "max_model_len": max(lengths) + 256,
        "max_num_batched_tokens": max(lengths) + 256,
    }
    # With --disk the node restarts: a connector that met the stopped node leaves it alone
    # for retry_interval (5 s by default); 1 s shortens the wait for the reconnection.
    extra = {"retry_interval": 1.0} if args.disk else {}
    engines = [
        Engine(python, model, connector={"target": node.target, "tenant": "bench", **extra},
               block_size=args.block_size, log_dir=work, name=name, nice=0, **spec)
        for name, node in zip(("a", "b"), (nodes[0], nodes[-1]), strict=True)
    ]  # fmt: skip
    if args.disk:  # the reference: the same engine without the connector
        engines.append(
            Engine(python, model, connector=None, block_size=args.block_size, log_dir=work,
                   name="r", nice=0, **spec)
        )  # fmt: skip
    out: dict[str, Any] = {
        "model": {"layers": args.layers, "hidden": args.hidden, "dtype": "float32"},
        "block_size": args.block_size,
        "settle_s": args.settle,
        "cluster": args.cluster,
        "verify_checksums": args.verify_checksums,
        "max_tokens": args.max_tokens,
        "disk": args.disk,
        "lengths": {},
    }
    try:
        a, b, *rest = (e.wait_ready() for e in engines)
        ref = rest[0] if rest else None
        for i, engine in enumerate(engines):  # warm-up of the engines' kernels
            one(engine, prompt(i, 64), cold=True)
        listed = 0  # blocks of host-1 in the directory
        for length in lengths:
            ways: tuple[str, ...] = ("cold", "kvstore", "local")
            if args.cluster:
                ways = ("cold", "remote", "kvstore", "local")
            elif args.disk:
                ways = ("cold", "reference", "kvstore", "local", "reference_local", "disk")
            rows: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
            node_disk: list[dict[str, float]] = []
            reconnects: list[int] = []
            for r in range(args.repeats):
                system = prompt(10_000 + 100 * length + r, length)
                settle = args.settle
                # A computes the system prompt (and stores it), B loads it (from node 1
                # through node 2 first with --cluster, then from node 2), then A hits its
                # own prefix cache.
                rows["cold"].append(one(a, system + prompt(1 + r, 16), cold=True, settle=settle))
                if redis is not None:
                    listed = wait_published(redis, "host-1", listed + length // args.block_size)
                    rows["remote"].append(
                        one(b, system + prompt(4 + r, 16), cold=True, settle=settle)
                    )
                if ref is not None:
                    # R computes B's prompt without the connector: the reference output and
                    # the recompute's TTFT; later its own hit on it (the yardstick).
                    rows["reference"].append(
                        one(ref, system + prompt(2 + r, 16), cold=True, settle=settle)
                    )
                rows["kvstore"].append(one(b, system + prompt(2 + r, 16), cold=True, settle=settle))
                rows["local"].append(one(a, system + prompt(3 + r, 16), cold=False, settle=settle))
                if ref is not None:
                    rows["reference_local"].append(
                        one(ref, system + prompt(2 + r, 16), cold=False, settle=settle)
                    )
                    # Only on disk: every block written, a clean stop (which flushes the
                    # write-behind anyway), a new process on the same file, empty memory.
                    node = nodes[0]
                    written = wait_written(node, length // args.block_size)
                    node.stop()
                    node.start()
                    reconnects.append(reconnect(a, b))
                    before = disk_metrics(metrics_port)
                    rows["disk"].append(
                        one(b, system + prompt(2 + r, 16), cold=True, settle=settle)
                    )
                    after = disk_metrics(metrics_port)
                    node_disk.append(
                        {"written_before_restart": written,
                         "rebuilt_blocks": after.get("kvstore_disk_rebuilt_blocks", 0.0),
                         **{k: after.get(m, 0.0) - before.get(m, 0.0)
                            for k, m in DISK_DELTAS.items()}}
                    )  # fmt: skip
            summary: dict[str, Any] = {}
            for way, results in rows.items():
                summary[way] = {
                    "ttft_s": statistics.median(x["ttft"] or x["wall"] for x in results),
                    "wall_s": statistics.median(x["wall"] for x in results),
                    "external_hit_tokens": statistics.median(x["external_hits"] for x in results),
                    "cached_tokens": statistics.median(x["cached_tokens"] for x in results),
                    "loaded_blocks": [x["kvstore_loaded"] for x in results],
                    "load_error_blocks": [x["kvstore_load_errors"] for x in results],
                }
            summary["kvstore_over_local"] = (
                summary["kvstore"]["ttft_s"] / summary["local"]["ttft_s"]
            )
            summary["cold_over_kvstore"] = summary["cold"]["ttft_s"] / summary["kvstore"]["ttft_s"]
            if args.cluster:
                remote = summary["remote"]["ttft_s"]
                summary["cold_over_remote"] = summary["cold"]["ttft_s"] / remote
                summary["remote_over_kvstore"] = remote / summary["kvstore"]["ttft_s"]
            if args.disk:
                from_disk = summary["disk"]["ttft_s"]
                summary["disk_over_kvstore"] = from_disk / summary["kvstore"]["ttft_s"]
                summary["cold_over_disk"] = summary["cold"]["ttft_s"] / from_disk
                summary["reference_over_disk"] = summary["reference"]["ttft_s"] / from_disk
                summary["exact"] = {
                    way: [
                        exactness(x, y) for x, y in zip(rows[way], rows["reference"], strict=True)
                    ]
                    for way in ("kvstore", "disk", "reference_local")
                }
                summary["exact"]["disk_equals_kvstore"] = all(
                    x["tokens"] == y["tokens"] and x["logprobs"] == y["logprobs"]
                    for x, y in zip(rows["disk"], rows["kvstore"], strict=True)
                )
                summary["node_disk"] = node_disk
                summary["reconnect_attempts"] = reconnects
            out["lengths"][str(length)] = summary
    finally:
        for engine in engines:
            engine.close()
        for node in nodes:
            node.stop()
        if redis is not None:
            redis.stop()
        (work / "kvstore.disk").unlink(missing_ok=True)  # preallocated: --disk-capacity
    print(json.dumps(out, indent=2))
    return 0


def run_families(args: argparse.Namespace) -> int:
    """``--family``: `benchmarks.bench_vllm_family` for each family named."""
    from benchmarks import bench_vllm_family

    python = vllm_python()
    if python is None:
        print(json.dumps({"error": "no python with vLLM (set KVSTORE_VLLM_PYTHON)"}))
        return 2
    families = [f for f in args.family.split(",") if f]
    unknown = sorted(set(families) - set(bench_vllm_family.BLOCKS))
    if unknown:
        print(
            json.dumps({"error": f"unknown families {unknown}: {sorted(bench_vllm_family.BLOCKS)}"})
        )
        return 2
    print(json.dumps(bench_vllm_family.main(python, families, args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
