"""Multi-round chat through two `vllm serve` engines behind a round robin: vLLM's own
prefix cache alone, kvstore with the prompts saved, kvstore with the answers saved too.

    KVSTORE_VLLM_PYTHON=... python -m benchmarks.bench_multiturn [--users 4] [--rounds 3]
        [--system 1024] [--question 64] [--answer 256] [--block-size 32]
        [--layers 4 --hidden 512] [--settle 1.5] [--ways plain,prompts,answers] [--quick]

Shaped like LMCache's multi-round QA benchmark. ``--users`` users share a
system prompt of ``--system`` tokens; each sends ``--rounds`` rounds. Round
r's prompt is the system prompt, the user's earlier questions each followed
by the answer's generated token ids (verbatim), and this round's question of
``--question`` tokens, sent as token ids to ``/v1/completions`` (streamed,
greedy, ``max_tokens = min_tokens = --answer`` with ``ignore_eos``: every
answer is exactly that long). Requests run one at a time, round by round,
user by user, each after ``--settle`` idle seconds (vLLM's processes
busy-poll after a request; on a small host the last busy engine would slow
the next request down).

The round robin is the client's: request after request alternates between
engine 0 and engine 1, and each round starts on the engine the last one did
not (user u's round r goes to engine ``(u + r) % 2``), so a user's
consecutive rounds always land on different engines (a plain counter with an
even number of users would keep every user on one engine). Each engine thus
sees every other round of a user: its own prefix cache holds the history up
to two rounds back, the rest has to be computed again or loaded from the node.

Three ways, one after another in one run, each with two fresh engines (a
random Llama made offline, float32, started with ``python -m
kvstore.integrations.vllm.cli serve``) and, for the kvstore ways, a fresh
cache node:

- ``plain``: no connector, vLLM's own prefix cache only;
- ``prompts``: the kvstore connector with ``save_decode`` false: only the
  prompts' full blocks are saved;
- ``answers``: the connector's defaults (``save_decode`` true): the full
  blocks of the generated tokens are saved too, so the other engine loads a
  user's whole history.

Prints progress to stderr and one JSON object on stdout: per way and round,
the client-side time to first token (time to the first streamed chunk with
tokens; median and p90 over the users) and, summed over the round's
requests from the engines' ``/metrics`` counters, the prompt tokens, vLLM's
own prefix-cache hits (``vllm:prefix_cache_hits_total``), the connector's
hits (``vllm:external_prefix_cache_hits_total``) and the prefill tokens
computed (prompt tokens minus both; ``computed_tokens`` is vLLM's own count,
``vllm:prompt_tokens_by_source_total{source="local_compute"}``, which
should agree), and how many answers matched the first way's (greedy, float32:
a cached prefix should change none). Most of the run is the six engine starts
(about a minute each on an idle 2-core machine, up to three when other jobs
load it): with the defaults about 7 minutes (10 under load), ``--quick``
about 4 (7 under load).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from benchmarks._stats import percentile
from kvstore.integrations.vllm.config import ConnectorConfig
from tests.integrations.vllm.common import tokens
from tests.integrations.vllm.engines import Node, vllm_python
from tests.integrations.vllm.models import make_llama
from tests.integrations.vllm.serve import MODEL_NAME, ServeProcess, samples

WAYS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "prompts": {"save_decode": False},
    "answers": {},
}
"""Each way's ``kv_connector_extra_config`` beyond the node and tenant; None: no connector."""

COUNTERS = {
    "prompt_tokens": ("vllm:prompt_tokens_total", ""),
    "local_hit_tokens": ("vllm:prefix_cache_hits_total", ""),
    "external_hit_tokens": ("vllm:external_prefix_cache_hits_total", ""),
    "computed_tokens": ("vllm:prompt_tokens_by_source_total", 'source="local_compute"'),
    "generation_tokens": ("vllm:generation_tokens_total", ""),
}
"""What the benchmark reads from ``/metrics``: (counter, a label it must carry), summed."""


def log(message: str) -> None:
    print(f"[bench_multiturn {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Workload:
    """The conversation's shape, in tokens."""

    users: int
    """Users sharing the system prompt."""
    rounds: int
    """Rounds (question, answer) each user sends."""
    system: int
    """Tokens of the shared system prompt."""
    question: int
    """Tokens of each question."""
    answer: int
    """Tokens generated for each answer (exactly)."""

    @property
    def max_model_len(self) -> int:
        """The last round's prompt plus its answer."""
        return self.system + self.rounds * (self.question + self.answer)


class ServeEngine(ServeProcess):
    """One `vllm serve` (`tests.integrations.vllm.serve`), read the way this benchmark needs."""

    def counters(self) -> dict[str, float]:
        """`COUNTERS` read from ``/metrics`` in one request (absent ones are 0)."""
        text = self.metrics()
        return {key: sum(samples(text, name, label)) for key, (name, label) in COUNTERS.items()}

    def stream(self, prompt: list[int], answer_tokens: int) -> tuple[float, list[int]]:
        """Stream one greedy completion of exactly ``answer_tokens`` tokens.

        Returns the time to the first streamed chunk with tokens and the generated ids.
        """
        body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": answer_tokens,
            "min_tokens": answer_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        ttft: float | None = None
        generated: list[int] = []
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as answer:
            for raw in answer:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[len("data:") :])["choices"]:
                    ids = choice.get("token_ids") or []
                    if ids and ttft is None:
                        ttft = time.perf_counter() - started
                    generated += ids
        if ttft is None or len(generated) != answer_tokens:
            raise RuntimeError(f"{self.name}: {len(generated)} tokens, not {answer_tokens}")
        return ttft, generated


def counted(
    engine: ServeEngine, before: dict[str, float], prompt: int, answer: int
) -> dict[str, float]:
    """The counters' growth over one request, once the engine has logged all of it.

    vLLM's API server records an iteration's counters as it handles its outputs,
    which may come after the last streamed chunk: wait until every generated token
    is counted.
    """
    deadline = time.monotonic() + 30.0
    while True:
        delta = {k: v - before[k] for k, v in engine.counters().items()}
        if delta["generation_tokens"] >= answer and delta["prompt_tokens"] >= prompt:
            return delta
        if time.monotonic() > deadline:
            raise RuntimeError(f"{engine.name}: /metrics did not count the request: {delta}")
        time.sleep(0.05)


def summarise(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT median and p90 (ms) and the token counts summed over ``requests``."""
    ttfts = [r["ttft_s"] for r in requests]
    out: dict[str, Any] = {
        "requests": len(requests),
        "ttft_median_ms": round(statistics.median(ttfts) * 1e3, 1),
        "ttft_p90_ms": round(percentile(ttfts, 0.9) * 1e3, 1),
    }
    for key in ("prompt_tokens", "local_hit_tokens", "external_hit_tokens", "computed_tokens"):
        out[key] = int(sum(r[key] for r in requests))
    out["prefill_tokens"] = (
        out["prompt_tokens"] - out["local_hit_tokens"] - out["external_hit_tokens"]
    )
    return out


def run_way(
    way: str,
    extra: dict[str, Any] | None,
    *,
    python: str,
    model: Path,
    work: Path,
    workload: Workload,
    block_size: int,
    settle: float,
) -> dict[str, Any]:
    """One way: a fresh node (kvstore ways) and two fresh engines, all rounds of all users."""
    started = time.monotonic()
    folder = work / way
    folder.mkdir()
    node: Node | None = None
    connector: dict[str, Any] | None = None
    if extra is not None:
        node = Node(folder, namespace_capacity="256MiB").start()
        connector = {"target": node.target, "tenant": "bench", **extra}
    engines = [
        ServeEngine(
            python,
            model,
            log_dir=folder,
            name=f"engine{i}",
            connector=connector,
            block_size=block_size,
            max_model_len=workload.max_model_len,
            max_num_batched_tokens=workload.max_model_len,  # a prompt's prefill in one step
            nice=0,
        )
        for i in range(2)
    ]
    try:
        for engine in engines:
            engine.wait_ready()
        ready = time.monotonic()
        log(f"{way}: engines ready after {ready - started:.0f} s")
        for i, engine in enumerate(engines):  # first-request costs out of round 0
            engine.stream(tokens(900 + i, workload.system + workload.question), 8)
        system = tokens(1000, workload.system)
        history = [list(system) for _ in range(workload.users)]
        answers: list[list[list[int]]] = [[] for _ in range(workload.users)]
        rounds: list[dict[str, Any]] = []
        everything: list[dict[str, Any]] = []
        for r in range(workload.rounds):
            requests = []
            for u in range(workload.users):
                engine = engines[(u + r) % 2]
                prompt = history[u] + tokens(10_000 * (u + 1) + r, workload.question)
                time.sleep(settle)
                before = engine.counters()
                ttft, answer = engine.stream(prompt, workload.answer)
                delta = counted(engine, before, len(prompt), workload.answer)
                requests.append({"ttft_s": ttft, **delta})
                history[u] = prompt + answer
                answers[u].append(answer)
                log(
                    f"{way} round {r} user {u} on {engine.name}: {len(prompt)} tokens, "
                    f"ttft {ttft * 1e3:.0f} ms, computed {delta['computed_tokens']:.0f}, "
                    f"local hits {delta['local_hit_tokens']:.0f}, "
                    f"external hits {delta['external_hit_tokens']:.0f}"
                )
            rounds.append({"round": r, **summarise(requests)})
            everything += requests
        return {
            "connector": connector,
            "rounds": rounds,
            "all_rounds": summarise(everything),
            "engines_start_s": round(ready - started, 1),
            "requests_s": round(time.monotonic() - ready, 1),
            "answers": answers,
        }
    finally:
        with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda e: e.stop(), engines))
        if node is not None:
            node.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--system", type=int, default=1024, help="system prompt tokens")
    parser.add_argument("--question", type=int, default=64, help="tokens of each question")
    parser.add_argument("--answer", type=int, default=256, help="tokens of each answer")
    parser.add_argument("--block-size", type=int, default=32, help="a multiple of 32 on CPU")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument(
        "--settle", type=float, default=1.5, help="idle seconds before each measured request"
    )
    parser.add_argument("--ways", default=",".join(WAYS), help="a subset of " + ",".join(WAYS))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 users, 2 rounds, 256-token system prompt, 96-token answers, a 2-layer model",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.users, args.rounds, args.system, args.question, args.answer = 3, 2, 256, 32, 96
        args.layers, args.hidden, args.settle = 2, 256, 1.0
    ways = args.ways.split(",")
    if unknown := set(ways) - set(WAYS):
        parser.error(f"unknown ways {sorted(unknown)}")
    python = vllm_python()
    if python is None:
        print(json.dumps({"error": "no python with vLLM (set KVSTORE_VLLM_PYTHON)"}))
        return 2
    workload = Workload(args.users, args.rounds, args.system, args.question, args.answer)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-multiturn-"))
    model = make_llama(
        work / "model", layers=args.layers, hidden=args.hidden, heads=args.hidden // 64,
        kv_heads=max(1, args.hidden // 256), max_positions=workload.max_model_len,
    )  # fmt: skip
    # Until the connector knows `save_decode`, an engine given it would refuse to start
    # (unknown keys are errors): run `prompts` without it, and say so.
    save_decode_known = "save_decode" in {f.name for f in fields(ConnectorConfig)}
    out: dict[str, Any] = {
        "benchmark": "bench_multiturn",
        "workload": {
            "users": workload.users, "rounds": workload.rounds, "system": workload.system,
            "question": workload.question, "answer": workload.answer,
        },
        "model": {"layers": args.layers, "hidden": args.hidden, "dtype": "float32"},
        "block_size": args.block_size,
        "settle_s": args.settle,
        "routing": "round robin by the client: user u's round r on engine (u + r) % 2",
        "save_decode_setting_known": save_decode_known,
        "ways": {},
    }  # fmt: skip
    log(f"work folder {work}; ways {ways}")
    answers = {}
    for way in ways:
        extra = WAYS[way]
        if extra is not None and not save_decode_known:
            extra = {k: v for k, v in extra.items() if k != "save_decode"}
        result = run_way(
            way, extra, python=python, model=model, work=work, workload=workload,
            block_size=args.block_size, settle=args.settle,
        )  # fmt: skip
        answers[way] = result.pop("answers")
        out["ways"][way] = result
    # Greedy answers of float32 engines: a cached prefix (vLLM's or kvstore's) should
    # change none of them, so the ways should agree.
    first = ways[0]
    for way in ways[1:]:
        same = sum(
            a == b
            for user_a, user_b in zip(answers[first], answers[way], strict=True)
            for a, b in zip(user_a, user_b, strict=True)
        )
        out["ways"][way][f"answers_same_as_{first}"] = same  # of all_rounds.requests
    out["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
