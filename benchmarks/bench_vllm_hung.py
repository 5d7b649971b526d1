"""What a hung cache node costs a vLLM engine: request latency with the node healthy,
hung (SIGSTOP: connections open, no answers) and absent, against an engine without
the connector, in one run.

    KVSTORE_VLLM_PYTHON=... python -m benchmarks.bench_vllm_hung [--requests 6]
        [--lookup-timeout 1.0] [--max-tokens 16]

Makes a small random Llama offline (float32), starts a cache node and two
engines (``plain`` without the connector, ``kv`` with it). Each phase sends
``--requests`` requests one at a time, each a fresh 256-token prompt (a miss:
the connector looks it up, then saves it) plus generated tokens, and
records each request's wall time and time to first token:

- ``plain``: the baseline, no connector;
- ``healthy``: ``kv`` with the node answering;
- ``hung``: ``kv`` while the node is stopped with SIGSTOP.

Prints one JSON object: per phase the median and max wall time and TTFT,
and ``hung_max_over_plain``, the slowest hung request less the slowest
baseline request (the promise: at most one ``lookup_timeout``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.integrations.vllm.engines import Engine, Node, vllm_python
from tests.integrations.vllm.models import make_llama


def prompts(seed: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(length)] for _ in range(count)]


def phase(engine: Engine, batch: list[list[int]], max_tokens: int) -> dict[str, Any]:
    results = engine.generate(batch, max_tokens=max_tokens)["results"]
    walls = [r["wall"] for r in results]
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {
        "wall_median_s": round(statistics.median(walls), 4),
        "wall_max_s": round(max(walls), 4),
        "ttft_median_s": round(statistics.median(ttfts), 4) if ttfts else None,
        "ttft_max_s": round(max(ttfts), 4) if ttfts else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--lookup-timeout", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    python = vllm_python()
    if python is None:
        print("no python with vLLM: set KVSTORE_VLLM_PYTHON", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-hung-"))
    model = make_llama(work / "model", layers=2, hidden=256, heads=4, kv_heads=2)
    node = Node(work, namespace_capacity="64MiB").start()
    settings = {
        "target": node.target,
        "tenant": "bench",
        "lookup_timeout": args.lookup_timeout,
        "retry_interval": 1.0,
    }
    engines = {
        "plain": Engine(python, model, connector=None, log_dir=work, name="plain", nice=0),
        "kv": Engine(python, model, connector=settings, log_dir=work, name="kv", nice=0),
    }
    out: dict[str, Any] = {"requests": args.requests, "lookup_timeout_s": args.lookup_timeout}
    try:
        for engine in engines.values():
            engine.wait_ready()
        warm = prompts(1, 2, 256)
        phase(engines["plain"], warm, args.max_tokens)
        phase(engines["kv"], warm, args.max_tokens)
        out["plain"] = phase(engines["plain"], prompts(2, args.requests, 256), args.max_tokens)
        out["healthy"] = phase(engines["kv"], prompts(3, args.requests, 256), args.max_tokens)
        node.pause()
        try:
            out["hung"] = phase(engines["kv"], prompts(4, args.requests, 256), args.max_tokens)
        finally:
            node.resume()
        out["hung_max_over_plain_s"] = round(
            out["hung"]["wall_max_s"] - out["plain"]["wall_max_s"], 4
        )
    finally:
        for engine in engines.values():
            engine.close()
        node.stop()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
