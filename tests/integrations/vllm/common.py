"""Prompts, runs and checks shared by the vLLM test modules.

Prompts are token ids; the block size is 32, so a 100-token system prompt
has 3 full blocks (96 tokens).
"""

from __future__ import annotations

import random
from typing import Any

from tests.integrations.vllm.engines import Engine, Node
from tests.waiting import wait_until

FAULTS_ENV = "KVSTORE_TEST_FAULTS"
"""The folder of the test connector's fault switches (tests/integrations/vllm/faulty.py)."""

BLOCK = 32
SYSTEM_TOKENS = 100
SYSTEM_HIT = SYSTEM_TOKENS // BLOCK * BLOCK  # 96: the system prompt's full blocks


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def system(seed: int) -> list[int]:
    return tokens(1000 + seed, SYSTEM_TOKENS)


USER_1, USER_2, USER_3 = tokens(1, 20), tokens(2, 27), tokens(3, 9)


def connector(node: Node, **extra: Any) -> dict[str, Any]:
    return {"target": node.target, "tenant": "acme", "retry_interval": 1.0, **extra}


def run(engine: Engine, prompt: list[int], *, cold: bool = True) -> dict[str, Any]:
    """One greedy generation; ``cold`` empties the engine's own prefix cache first."""
    if cold:
        engine.command(reset_prefix_cache=True)
    answer = engine.generate([prompt])
    return {**answer["results"][0], **{k: v for k, v in answer.items() if k != "results"}}


def max_logprob_diff(x: dict[str, Any], y: dict[str, Any]) -> float:
    return max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"], strict=True))


def reference(ref: Engine, prompt: list[int], warm_from: list[int]) -> tuple[dict[str, Any], float]:
    """The cold output of ``prompt``, and how far vLLM's own prefix-cache hit strays from it.

    The hit is taken the way the connector's is: the shared prefix computed
    while running another prompt (``warm_from``), then ``prompt`` reusing it.
    """
    cold = run(ref, prompt)
    run(ref, warm_from)
    warm = run(ref, prompt, cold=False)
    assert warm["local_hits"] > 0, "the reference engine's own prefix cache did not hit"
    assert warm["tokens"] == cold["tokens"]
    return cold, max_logprob_diff(cold, warm)


def assert_same_output(got: dict[str, Any], ref: dict[str, Any], tolerance: float) -> None:
    assert got["tokens"] == ref["tokens"]
    assert max_logprob_diff(got, ref) <= tolerance


def assert_nothing_pinned(node: Node, within: float = 10.0) -> None:
    """The node's pins and WRITING slots drop to 0 within ``within`` seconds (releases and
    saves finish in the background)."""
    stats = wait_until(
        node.stats,
        ok=lambda s: s.pinned == 0 and s.writing == 0,
        within=within,
        interval=0.2,
        what="no pinned and no WRITING blocks on the node",
    )
    assert stats.pinned == 0
    assert stats.writing == 0
