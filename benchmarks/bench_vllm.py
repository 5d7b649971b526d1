"""vLLM time to first token with a long shared system prompt: cold, warm from kvstore,
and vLLM's own in-process prefix-cache hit (the limit), in one run.

    KVSTORE_VLLM_PYTHON=... python -m benchmarks.bench_vllm [--lengths 1024,2048,4096,8192]
        [--layers 6 --hidden 768] [--repeats 3] [--settle 2] [--quick] [--cluster]
        [--verify-checksums peer|all]

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

Each request is the system prompt plus a 16-token user prompt and one
generated token. Prints one JSON object: per length, the median time to
first token (vLLM's ``first_token_latency``) and the request's wall time, and
the ratios the goals are stated in (kvstore / local, cold / kvstore; with
``--cluster`` also cold / remote and remote / kvstore).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.integrations.vllm.engines import Engine, Node, published, vllm_python
from tests.integrations.vllm.models import make_llama
from tests.redis.server import RedisServer


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def one(engine: Engine, tokens: list[int], *, cold: bool, settle: float = 0.0) -> dict[str, Any]:
    if cold:
        engine.command(reset_prefix_cache=True)
    # After a request, vLLM's processes busy-wait (its shared-memory queues poll for
    # 1 s, OpenMP threads spin): on a small host the engine that ran last would slow
    # the next measured request down. Let every engine go idle first.
    time.sleep(settle)
    answer = engine.generate([tokens], max_tokens=1)
    return {**answer["results"][0], "external_hits": answer["external_hits"]}


def start_node(workdir: Path, redis: RedisServer | None, verify: str = "peer") -> Node:
    """A node with a 1 GiB namespace; in the cluster on ``redis`` when given; ``verify``:
    its ``verify_checksums`` ("all": every local load's bytes are checked too)."""
    workdir.mkdir(parents=True, exist_ok=True)
    flags: tuple[str, ...] = ("--verify-checksums", verify)
    if redis is not None:
        flags += (
            "--redis-url", redis.url, "--node-id", workdir.name, "--cluster-token", "bench",
            "--heartbeat-seconds", "0.5", "--directory-flush-seconds", "0.01",
        )  # fmt: skip
    return Node(workdir, namespace_capacity="1GiB", extra_args=flags).start()


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
        default="peer",
        help="the nodes' verify_checksums: 'all' checks every local load's bytes too",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats, args.layers, args.hidden = "1024", 1, 2, 256
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
    nodes = [
        start_node(work / name, redis, args.verify_checksums)
        for name in (("host-1", "host-2") if redis else ("n",))
    ]
    spec = {"max_model_len": max(lengths) + 256, "max_num_batched_tokens": max(lengths) + 256}
    engines = [
        Engine(python, model, connector={"target": node.target, "tenant": "bench"},
               block_size=args.block_size, log_dir=work, name=name, **spec)
        for name, node in zip(("a", "b"), (nodes[0], nodes[-1]), strict=True)
    ]  # fmt: skip
    out: dict[str, Any] = {
        "model": {"layers": args.layers, "hidden": args.hidden, "dtype": "float32"},
        "block_size": args.block_size,
        "settle_s": args.settle,
        "cluster": args.cluster,
        "verify_checksums": args.verify_checksums,
        "lengths": {},
    }
    try:
        a, b = (e.wait_ready() for e in engines)
        one(a, prompt(0, 64), cold=True)  # warm-up of both engines' kernels
        one(b, prompt(1, 64), cold=True)
        listed = 0  # blocks of host-1 in the directory
        for length in lengths:
            ways = (
                ("cold", "remote", "kvstore", "local")
                if args.cluster
                else ("cold", "kvstore", "local")
            )
            rows: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
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
                rows["kvstore"].append(one(b, system + prompt(2 + r, 16), cold=True, settle=settle))
                rows["local"].append(one(a, system + prompt(3 + r, 16), cold=False, settle=settle))
            summary: dict[str, Any] = {}
            for way, results in rows.items():
                summary[way] = {
                    "ttft_s": statistics.median(x["ttft"] or x["wall"] for x in results),
                    "wall_s": statistics.median(x["wall"] for x in results),
                    "external_hit_tokens": statistics.median(x["external_hits"] for x in results),
                    "cached_tokens": statistics.median(x["cached_tokens"] for x in results),
                }
            summary["kvstore_over_local"] = (
                summary["kvstore"]["ttft_s"] / summary["local"]["ttft_s"]
            )
            summary["cold_over_kvstore"] = summary["cold"]["ttft_s"] / summary["kvstore"]["ttft_s"]
            if args.cluster:
                remote = summary["remote"]["ttft_s"]
                summary["cold_over_remote"] = summary["cold"]["ttft_s"] / remote
                summary["remote_over_kvstore"] = remote / summary["kvstore"]["ttft_s"]
            out["lengths"][str(length)] = summary
    finally:
        for engine in engines:
            engine.close()
        for node in nodes:
            node.stop()
        if redis is not None:
            redis.stop()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
