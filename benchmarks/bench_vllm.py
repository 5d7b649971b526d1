"""vLLM time to first token with a long shared system prompt: cold, warm from kvstore,
and vLLM's own in-process prefix-cache hit (the limit), in one run.

    KVSTORE_VLLM_PYTHON=... python -m benchmarks.bench_vllm [--lengths 1024,2048,4096,8192]
        [--layers 6 --hidden 768] [--repeats 3] [--settle 2] [--quick]

Makes a random Llama offline (float32), starts a cache node and two vLLM
engines with the kvstore connector (`tests/integrations/vllm/driver.py`):

- ``cold``: engine A, its prefix cache emptied, a system prompt nobody cached;
- ``kvstore``: engine B, its prefix cache emptied, the system prompt A stored;
- ``local``: engine A again on the same system prompt: vLLM's own prefix-cache hit.

Each request is the system prompt plus a 16-token user prompt and one
generated token. Prints one JSON object: per length, the median time to
first token (vLLM's ``first_token_latency``) and the request's wall time, and
the ratios the goal is stated in (kvstore / local, cold / kvstore).
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

from tests.integrations.vllm.engines import Engine, Node, vllm_python
from tests.integrations.vllm.models import make_llama


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
    node = Node(work, namespace_capacity="1GiB").start()
    conn = {"target": node.target, "tenant": "bench"}
    spec = {"max_model_len": max(lengths) + 256, "max_num_batched_tokens": max(lengths) + 256}
    engines = [
        Engine(python, model, connector=conn, block_size=args.block_size, log_dir=work,
               name=name, **spec)
        for name in ("a", "b")
    ]  # fmt: skip
    out: dict[str, Any] = {
        "model": {"layers": args.layers, "hidden": args.hidden, "dtype": "float32"},
        "block_size": args.block_size,
        "settle_s": args.settle,
        "lengths": {},
    }
    try:
        a, b = (e.wait_ready() for e in engines)
        one(a, prompt(0, 64), cold=True)  # warm-up of both engines' kernels
        one(b, prompt(1, 64), cold=True)
        for length in lengths:
            rows: dict[str, list[dict[str, Any]]] = {"cold": [], "kvstore": [], "local": []}
            for r in range(args.repeats):
                system = prompt(10_000 + 100 * length + r, length)
                settle = args.settle
                # A computes the system prompt (and stores it), B loads it from the
                # node, then A hits its own prefix cache.
                rows["cold"].append(one(a, system + prompt(1 + r, 16), cold=True, settle=settle))
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
            out["lengths"][str(length)] = summary
    finally:
        for engine in engines:
            engine.close()
        node.stop()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
