"""Prompts, runs and checks shared by the vLLM test modules.

Prompts are token ids; the block size is 32, so a 100-token system prompt
has 3 full blocks (96 tokens).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from kvstore.api.wire import layout_from_proto
from kvstore.client import SyncClient
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


def wait_saved(
    node: Node,
    prompt: list[int],
    blocks: int,
    *,
    tenant: str = "acme",
    model: Callable[[str], bool] = lambda model_id: True,
    within: float = 120.0,
) -> None:
    """Wait until ``tenant`` finds the first ``blocks`` full blocks of ``prompt`` on the node,
    in every namespace whose model id ``model`` accepts (a TP engine has one per rank).

    An engine answers before its saves land (they are stored behind the forward,
    docs/vllm.md), so a test that needs the node to hold a prompt waits for it here, as
    a user's next turn would come after them; on a loaded host that can take seconds.
    """

    def held() -> int:
        with SyncClient(node.target, tenant=tenant, timeout=30.0) as client:
            found = []
            for ns_stats in client.stats(timeout=30.0).namespaces:
                if not model(ns_stats.model_id):
                    continue
                layout = layout_from_proto(ns_stats.layout)
                ns = client.register_namespace(ns_stats.model_id, layout, timeout=30.0)
                found.append(client.lookup(ns, prompt, timeout=30.0).hit_blocks)
        return min(found, default=0)

    wait_until(
        held,
        ok=lambda n: n >= blocks,
        what=f"{tenant}'s {blocks} saved blocks on the node",
        within=within,
        interval=0.2,
    )


def seed(
    engine: Engine,
    node: Node,
    prompt: list[int],
    *,
    saved: list[int],
    blocks: int,
    tenant: str = "acme",
    model: Callable[[str], bool] = lambda model_id: True,
) -> dict[str, Any]:
    """Run ``prompt`` so that the node holds the first ``blocks`` full blocks of ``saved``.

    Once more if they do not land (`wait_saved`): a stall of the host can make the engine
    give up on the node for a while (docs/vllm.md, failure table), and it then saves
    nothing of that request, by design. Returns the answer of the last run.
    """
    answer = run(engine, prompt)
    try:
        wait_saved(node, saved, blocks, tenant=tenant, model=model)
    except AssertionError:
        answer = run(engine, prompt)
        wait_saved(node, saved, blocks, tenant=tenant, model=model)
    return answer


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
