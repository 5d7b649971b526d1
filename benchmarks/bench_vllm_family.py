"""`bench_vllm --family`: each model family through the connector, in one run.

    KVSTORE_VLLM_PYTHON=... python -m benchmarks.bench_vllm --family gemma3,sliding,mla
        [--lengths 1024,2048] [--repeats 3] [--layers 6 --hidden 512] [--settle 2]

Per family (`tests/integrations/vllm/models.py`: a Gemma-3-style hybrid with
five sliding-window layers to one global, a model whose every layer slides,
a DeepSeek-V2-style MLA model; random weights, float32), one cache node and
two engines with the connector, and per prompt length the median time to
first token of:

- ``cold``: engine A, its prefix cache emptied, a system prompt nobody cached;
- ``kvstore``: engine B, its prefix cache emptied, the prompt A stored;
- ``local``: engine A again: vLLM's own prefix-cache hit (none for MLA on the
  CPU build, which turns prefix caching off for it: that row is a recompute).

Also per length: the blocks B copied for the hit against the prefix's blocks
over every group (``copied_over_prefix``: a sliding-window group copies its
window, not the prefix), and the bytes that copy moved. For ``mla`` a third
engine at TP=2 saves the same prompt: ``node_bytes_per_token`` at TP=2 and at
TP=1 (the goal is a ratio of 1.0: MLA's latent is stored once, not per rank).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.integrations.vllm.engines import Engine, Node
from tests.integrations.vllm.models import SLIDING_WINDOW, make_model

BLOCKS = {"gemma3": 32, "sliding": 32, "mla": 16}
"""Tokens per block: vLLM's CPU build forces 16 for MLA; 32 is its smallest otherwise."""

ENGINE = {"mla": {"attention_backend": "CPU_MLA"}}
"""Engine options per family: MLA runs vLLM's reference CPU kernel (float32)."""


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def timed(engine: Engine, prompt: list[int], *, cold: bool, settle: float) -> dict[str, Any]:
    """One request (its prefix cache emptied first when ``cold``), after ``settle`` idle s."""
    if cold:
        engine.command(reset_prefix_cache=True)
    time.sleep(settle)
    answer = engine.generate([prompt], max_tokens=1)
    return {**answer["results"][0], "loaded": answer["kvstore_loaded"]}


def namespaces(node: Node) -> dict[str, Any]:
    return {ns.model_id: ns for ns in node.stats().namespaces if ns.model_id.startswith("vllm:")}


def copied_bytes(family: str, node: Node, length: int, block: int) -> tuple[int, int, int]:
    """(blocks copied for a hit of ``length`` tokens' full blocks, the prefix's blocks over
    every group, and the bytes copied), from the groups' namespaces on ``node``."""
    hit = length // block * block
    copied = prefix = nbytes = 0
    for model_id, ns in namespaces(node).items():
        if "#tp-" in model_id:
            continue
        blocks = hit // block
        if "-sliding-w" in model_id:
            blocks -= max(0, hit - SLIDING_WINDOW + 1) // block
        copied += blocks
        prefix += hit // block
        nbytes += blocks * ns.block_bytes
    return copied, prefix, nbytes


def node_bytes_per_token(node: Node) -> dict[str, float]:
    """Bytes the node holds per saved token of a prompt, at TP=1 and TP=2: over every
    namespace of that TP size holding blocks (per rank, if MLA were stored per rank)."""
    out = {"tp1": 0.0, "tp2": 0.0}
    for model_id, ns in namespaces(node).items():
        if ns.ready:
            out["tp2" if "#tp-2" in model_id else "tp1"] += ns.block_bytes / ns.block_size
    out["tp2_over_tp1"] = out["tp2"] / out["tp1"] if out["tp1"] else 0.0
    return out


def run_family(
    python: str, family: str, lengths: list[int], repeats: int, size: dict[str, int], settle: float
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"bench-{family}-"))
    block = BLOCKS[family]
    longest = max(lengths) + 256
    model = make_model(family, work / "model", max_positions=longest, **size)
    # One namespace per KV cache group (a 6-layer Gemma-3 style model has six), each
    # with its own capacity: 32 MiB each stays inside the node's 256 MiB.
    node = Node(work, namespace_capacity="32MiB").start()
    spec: dict[str, Any] = {
        "block_size": block,
        "max_model_len": longest,
        "max_num_batched_tokens": longest,
        **ENGINE.get(family, {}),
    }
    conn = {"target": node.target, "tenant": "bench"}
    engines = [
        Engine(python, model, connector=conn, log_dir=work, name=name, nice=0, **spec)
        for name in ("a", "b")
    ]
    out: dict[str, Any] = {"block_size": block, "lengths": {}}
    try:
        a, b = (engine.wait_ready() for engine in engines)
        for engine in (a, b):
            timed(engine, tokens(7, 64), cold=True, settle=0)  # warm-up
        for length in lengths:
            rows: dict[str, list[dict[str, Any]]] = {"cold": [], "kvstore": [], "local": []}
            for r in range(repeats):
                system = tokens(10_000 + length + r, length)
                rows["cold"].append(timed(a, system + tokens(1 + r, 16), cold=True, settle=settle))
                rows["kvstore"].append(
                    timed(b, system + tokens(2 + r, 16), cold=True, settle=settle)
                )
                rows["local"].append(
                    timed(a, system + tokens(3 + r, 16), cold=False, settle=settle)
                )
            copied, prefix, nbytes = copied_bytes(family, node, length, block)
            out["lengths"][str(length)] = {
                **{
                    way: {"ttft_s": statistics.median(x["ttft"] or x["wall"] for x in results)}
                    for way, results in rows.items()
                },
                "loaded_blocks": [x["loaded"] for x in rows["kvstore"]],
                "expected_copied_blocks": copied,
                "prefix_blocks_all_groups": prefix,
                "copied_over_prefix": copied / prefix if prefix else 0.0,
                "copied_bytes_per_hit": nbytes,
            }
        out["groups"] = sorted(model_id.rsplit("#", 1)[-1] for model_id in namespaces(node))
        if family == "mla":
            out["node_bytes_per_token"] = mla_tp2_bytes(python, model, node, work, spec, lengths)
    finally:
        for engine in engines:
            engine.close()
        node.stop()
    return out


def mla_tp2_bytes(
    python: str, model: Path, node: Node, work: Path, spec: dict[str, Any], lengths: list[int]
) -> dict[str, float]:
    """A TP=2 engine saves the first length's prompt of this run (A saved it at TP=1):
    bytes per token on the node at TP=2 against TP=1."""
    tp2 = Engine(
        python, model, connector={"target": node.target, "tenant": "bench"}, log_dir=work,
        name="tp2", nice=0, tensor_parallel_size=2,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, **spec,
    )  # fmt: skip
    try:
        tp2.wait_ready()
        timed(tp2, tokens(10_000 + lengths[0], lengths[0]) + tokens(1, 16), cold=True, settle=0)
        deadline = time.monotonic() + 60
        while not node_bytes_per_token(node)["tp2"] and time.monotonic() < deadline:
            time.sleep(0.5)  # saves land behind the answer
        return node_bytes_per_token(node)
    finally:
        tp2.close()


def main(python: str, families: list[str], args: Any) -> dict[str, Any]:
    """The JSON `bench_vllm --family` prints."""
    lengths = [int(x) for x in args.lengths.split(",")]
    size = {"layers": args.layers, "hidden": args.hidden}
    return {
        "model": {**size, "dtype": "float32"},
        "settle_s": args.settle,
        "families": {
            family: run_family(python, family, lengths, args.repeats, size, args.settle)
            for family in families
        },
    }
