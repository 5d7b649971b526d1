"""Every model family vLLM's CPU build serves, through the connector (real vLLM, no mocks).

One tiny random checkpoint per family (`models.make_model`): a Gemma-3-style
hybrid (two sliding-window layers and a global one: three KV cache groups,
vLLM's hybrid manager on), a Mistral-style model whose every layer slides,
and a DeepSeek-V2-style model with MLA (at TP=1 and TP=2). For each, engine
``a`` computes a long system prompt, a fresh engine ``b`` loads it from the
node, and ``b``'s tokens equal those of ``ref``, an engine without the
connector (logprobs within `TOLERANCE`). A sliding-window group loads only
the blocks vLLM keeps for it (the window before the hit), never the prefix.
Each test has a node of its own, so the node's namespaces are its family's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.common import (
    assert_nothing_pinned,
    connector,
    max_logprob_diff,
    run,
    tokens,
    wait_saved,
)
from tests.integrations.vllm.engines import Engine, Node, running
from tests.integrations.vllm.models import SLIDING_WINDOW, make_model
from tests.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(1200)]

TOLERANCE = 1e-3
"""Largest logprob difference allowed between a load from the node and a cold run."""

SYSTEM = tokens(4242, 200)
"""The system prompt: 6 full blocks of 32 tokens (12 of 16), 192 tokens."""
USER_1, USER_2 = tokens(4243, 20), tokens(4244, 27)
HIT = 192

MLA: dict[str, Any] = {"block_size": 16, "attention_backend": "CPU_MLA"}
"""vLLM's CPU build runs MLA with its reference kernel in float32 (the AMX one takes
bf16 only) and forces 16-token blocks."""

TP2: dict[str, Any] = {"tensor_parallel_size": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}


def window_blocks(block: int) -> int:
    """Blocks vLLM keeps for a sliding-window group at the hit: the window's."""
    first_kept = (HIT - SLIDING_WINDOW + 1) // block
    return HIT // block - first_kept


@pytest.fixture
def node(tmp_path: Path) -> Any:
    node = Node(tmp_path / "node", namespace_capacity="8MiB")
    (tmp_path / "node").mkdir()
    node.start()
    try:
        yield node
    finally:
        node.stop()


def engines(
    vllm_py: str, model: Path, node: Node, logs: Path, specs: dict[str, dict[str, Any]]
) -> dict[str, Engine]:
    """Engines named by ``specs`` (each: ``connector`` extras or None, and engine options)."""
    logs.mkdir(parents=True, exist_ok=True)
    started = {}
    for name, spec in specs.items():
        spec = dict(spec)
        extra = spec.pop("connector", None)
        started[name] = Engine(
            vllm_py,
            model,
            connector=None if extra is None else connector(node, **extra),
            log_dir=logs,
            name=name,
            **spec,
        )
    return started


def namespace_stats(node: Node) -> list[Any]:
    return [ns for ns in node.stats().namespaces if ns.model_id.startswith("vllm:")]


def load_and_compare(
    a: Engine, b: Engine, ref: Engine, node: Node, *, block: int, loaded: int
) -> dict[str, Any]:
    """``a`` saves the system prompt, ``b`` loads it: ``b`` answers as ``ref`` cold."""
    first = run(a, SYSTEM + USER_1)
    assert first["external_hits"] == 0
    wait_saved(node, SYSTEM, HIT // block)
    got = run(b, SYSTEM + USER_2)
    assert got["external_hits"] == HIT  # the system prompt's full blocks, from the node
    assert got["local_hits"] == 0
    assert got["kvstore_loaded"] == loaded
    assert got["kvstore_load_errors"] == 0
    cold = run(ref, SYSTEM + USER_2)
    assert got["tokens"] == cold["tokens"]
    assert max_logprob_diff(got, cold) <= TOLERANCE
    assert_nothing_pinned(node)
    return got


def test_a_gemma3_style_hybrid_loads_each_group_and_only_the_window(
    vllm_py: str, node: Node, tmp_path: Path
) -> None:
    """Three KV cache groups (two sliding windows, one global), each its own namespace:
    the global group loads the prefix's 6 blocks, each sliding one only its window's.
    A load that fails on this model (several groups: vLLM takes no block-level errors)
    is a recompute of the request, never a crash."""
    model = make_model("gemma3", tmp_path / "gemma3")
    specs: dict[str, dict[str, Any]] = {
        "ref": {},
        "a": {"connector": {}},
        "b": {"connector": {}},
        "f": {"connector": {"fail_loads": True}},
    }
    with running(engines(vllm_py, model, node, tmp_path / "logs", specs)) as e:
        window = window_blocks(32)
        load_and_compare(e["a"], e["b"], e["ref"], node, block=32, loaded=6 + 2 * window)
        ids = sorted(ns.model_id.rsplit("#", 1)[1] for ns in namespace_stats(node))
        assert ids == ["g0-sliding-w64", "g1-sliding-w64", "g2-full"]
        failed = run(e["f"], SYSTEM + USER_2)
        assert failed["kvstore_load_errors"] > 0 and failed["kvstore_loaded"] == 0
        cold = run(e["ref"], SYSTEM + USER_2)
        assert failed["tokens"] == cold["tokens"]
        assert max_logprob_diff(failed, cold) <= TOLERANCE
        assert run(e["f"], SYSTEM + USER_1)["tokens"] == run(e["ref"], SYSTEM + USER_1)["tokens"]
        assert_nothing_pinned(node)


def test_an_all_sliding_window_model_loads_only_its_window(
    vllm_py: str, node: Node, tmp_path: Path
) -> None:
    model = make_model("sliding", tmp_path / "sliding")
    specs: dict[str, dict[str, Any]] = {"ref": {}, "a": {"connector": {}}, "b": {"connector": {}}}
    with running(engines(vllm_py, model, node, tmp_path / "logs", specs)) as e:
        load_and_compare(e["a"], e["b"], e["ref"], node, block=32, loaded=window_blocks(32))


def test_an_mla_model_loads_its_latent_kv(vllm_py: str, node: Node, tmp_path: Path) -> None:
    model = make_model("mla", tmp_path / "mla")
    specs: dict[str, dict[str, Any]] = {
        "ref": dict(MLA),
        "a": {"connector": {}, **MLA},
        "b": {"connector": {}, **MLA},
    }
    with running(engines(vllm_py, model, node, tmp_path / "logs", specs)) as e:
        load_and_compare(e["a"], e["b"], e["ref"], node, block=16, loaded=HIT // 16)
        (ns,) = namespace_stats(node)
        assert ns.block_bytes == 2 * 16 * 576 * 4  # 2 layers of one 576-wide latent a token


def test_mla_at_tp2_is_stored_once_and_loaded_by_every_rank(
    vllm_py: str, node: Node, tmp_path: Path
) -> None:
    """MLA's latent is the same on every rank: one namespace for both ranks, saved by
    rank 0, loaded by both; the node holds as many bytes for the prompt as at TP=1."""
    model = make_model("mla", tmp_path / "mla")
    specs: dict[str, dict[str, Any]] = {
        "ref2": {**MLA, **TP2},
        "two": {"connector": {"lookup_timeout": 60.0}, **MLA, **TP2},
        "one": {"connector": {}, **MLA},
    }
    with running(engines(vllm_py, model, node, tmp_path / "logs", specs)) as e:
        cold = run(e["ref2"], SYSTEM + USER_2)
        run(e["one"], SYSTEM + USER_1)
        run(e["two"], SYSTEM + USER_1)
        wait_saved(node, SYSTEM, HIT // 16)

        def by_tp() -> dict[str, Any]:
            return {ns.model_id.rsplit("#", 1)[1]: ns for ns in namespace_stats(node)}

        # The same prompt at TP=1 and TP=2 (its decode blocks too: saves land behind the
        # answers): one namespace at TP=2, not one a rank, holding the same bytes.
        stats = wait_until(
            by_tp,
            ok=lambda s: len(s) == 2 and s["tp-2"].ready == s["g0-mla"].ready,
            what="both engines' saves of the prompt",
            within=60,
            interval=0.5,
        )
        assert sorted(stats) == ["g0-mla", "tp-2"]
        tp1, tp2 = stats["g0-mla"], stats["tp-2"]
        assert tp2.ready * tp2.block_bytes == tp1.ready * tp1.block_bytes  # node bytes 1.0x
        got = run(e["two"], SYSTEM + USER_2)
        assert got["external_hits"] == HIT
        assert got["kvstore_loaded"] == 2 * HIT // 16  # each rank copied every block
        assert got["tokens"] == cold["tokens"]
        assert max_logprob_diff(got, cold) <= TOLERANCE
        assert_nothing_pinned(node)


def test_a_save_far_over_the_staging_budget_lands_in_parts(
    vllm_py: str, node: Node, tmp_path: Path
) -> None:
    """``max_pending_save_bytes`` of two blocks and a six-block prompt: the save is staged
    in parts (the first ones while the request runs, the rest once it finished, before
    vLLM frees its blocks), every block lands, and a fresh engine loads all six."""
    model = make_model("llama", tmp_path / "llama")
    two_blocks = 2 * (2 * 2 * 32 * 2 * 32 * 4)  # K and V, 2 layers, 32 tokens, 2 heads of 32
    specs: dict[str, dict[str, Any]] = {
        "ref": {},
        "a": {"connector": {"max_pending_save_bytes": two_blocks}},
        "b": {"connector": {}},
    }
    with running(engines(vllm_py, model, node, tmp_path / "logs", specs)) as e:
        load_and_compare(e["a"], e["b"], e["ref"], node, block=32, loaded=HIT // 32)
