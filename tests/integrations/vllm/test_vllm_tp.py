"""Tensor-parallel engines share prefixes rank by rank (real vLLM at TP=2, no mocks).

vLLM's CPU build runs ``tensor_parallel_size=2`` with its multiprocessing
executor (one worker process per rank; ``VLLM_CPU_OMP_THREADS_BIND`` gives
each rank one core, as this host has one NUMA node). Four engines share one
node: ``a2`` and ``b2`` at TP=2 with the connector, ``ref2`` at TP=2
without it (the reference outputs), and ``one`` at TP=1 with the connector.
Each rank stores its share of the KV heads in a namespace of its own
(``<model id>#tp-2.<rank>``), so TP=2 engines share with each other and
never with a TP=1 engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.client.errors import ServerUnavailable
from tests.integrations.vllm.common import (
    BLOCK,
    FAULTS_ENV,
    SYSTEM_HIT,
    USER_1,
    USER_2,
    USER_3,
    assert_nothing_pinned,
    connector,
    max_logprob_diff,
    run,
    seed,
    system,
    wait_saved,
)
from tests.integrations.vllm.engines import Engine, Node, running
from tests.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(900)]

TP2: dict[str, Any] = {"tensor_parallel_size": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
LOOKUP_TIMEOUT = 60.0
"""Eleven vLLM processes share this module's 2-core host and busy-poll after each request.
A TP=2 engine's scheduler, whose engine-core loop steps its two workers over shared memory
while a request waits for its lookup, answered lookups in 0.01-0.04 s mostly but up to
11 s (over 15 s twice) here, its client thread starved of CPU. These tests are about
what is shared, not how fast (bench_vllm measures that): a lookup may take its time."""
HELD_LEASE_TTL = 900.0
"""a2's lease TTL: longer than any stall of the host that `held_rank_pins` waits out."""
HELD_WAIT = 400.0
"""How long the held-load test waits for the node to show the pins (stalls included)."""
ENGINE_DIFF = 1e-5
"""Logprob difference between an engine with the connector and one without, measured
(test_vllm_connector): merely enabling a connector moves float32 rounding a few ulps."""


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder whose files switch engine ``a2``'s faults on (`faulty`)."""
    return tmp_path_factory.mktemp("tp-faults")


@pytest.fixture(scope="module")
def engines(
    vllm_py: str,
    tiny_model: Path,
    node: Node,
    faults: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Engine]]:
    logs = tmp_path_factory.mktemp("tp-engines")
    specs: dict[str, dict[str, Any]] = {
        "a2": {
            # A long lease: the held-load test's pins must outlive a stall of the host
            # (below), which a 30 s lease would end, dropping them by design.
            "connector": connector(node, lookup_timeout=LOOKUP_TIMEOUT, lease_ttl=HELD_LEASE_TTL),
            "faulty": True,
            "tensor_parallel_size": 2,
            "env": {**TP2["env"], FAULTS_ENV: str(faults)},
        },
        "b2": {"connector": connector(node, lookup_timeout=LOOKUP_TIMEOUT), **TP2},
        "ref2": {"connector": None, **TP2},
        "one": {"connector": connector(node, lookup_timeout=LOOKUP_TIMEOUT)},
    }
    started = {
        name: Engine(vllm_py, tiny_model, log_dir=logs, name=name, **spec)
        for name, spec in specs.items()
    }
    with running(started) as ready:
        yield ready


def is_tp2(model_id: str) -> bool:
    """Whether a namespace is a TP=2 rank's."""
    return "#tp-2." in model_id


def rank_blocks(node: Node) -> dict[str, int]:
    """Ready blocks per tensor-parallel rank namespace (by model id suffix)."""
    return {
        ns.model_id.rsplit("#", 1)[1]: int(ns.ready)
        for ns in node.stats().namespaces
        if "#tp-" in ns.model_id
    }


def test_tp2_engines_share_a_prefix_and_an_answer_exactly(engines, node) -> None:
    a2, b2, ref2 = engines["a2"], engines["b2"], engines["ref2"]
    first = run(a2, system(60) + USER_1)
    assert first["external_hits"] == 0
    assert first["tokens"] == run(ref2, system(60) + USER_1)["tokens"]
    wait_saved(node, system(60), SYSTEM_HIT // BLOCK, model=is_tp2)
    blocks = rank_blocks(node)
    assert set(blocks) == {"tp-2.0", "tp-2.1"}
    assert blocks["tp-2.0"] == blocks["tp-2.1"] > 0  # each rank stored its share
    got = run(b2, system(60) + USER_2)
    assert got["external_hits"] == SYSTEM_HIT  # every rank's blocks loaded
    want = run(ref2, system(60) + USER_2)
    assert got["tokens"] == want["tokens"]
    assert max_logprob_diff(got, want) <= ENGINE_DIFF
    # A chat's next turn on the other engine loads the answer's blocks too.
    history = system(60) + USER_2 + got["tokens"]
    wait_saved(node, history, (len(history) - 1) // BLOCK, model=is_tp2)
    turn2 = run(a2, history + USER_3)
    assert turn2["external_hits"] == (len(history) - 1) // BLOCK * BLOCK
    assert turn2["tokens"] == run(ref2, history + USER_3)["tokens"]
    assert_nothing_pinned(node)


def test_tp1_and_tp2_engines_never_share(engines, node) -> None:
    a2, one = engines["a2"], engines["one"]
    run(one, system(61) + USER_1)
    assert run(a2, system(61) + USER_2)["external_hits"] == 0
    run(a2, system(62) + USER_1)
    assert run(one, system(62) + USER_2)["external_hits"] == 0
    wait_saved(node, system(61), SYSTEM_HIT // BLOCK, model=lambda m: not is_tp2(m))
    wait_saved(node, system(62), SYSTEM_HIT // BLOCK, model=is_tp2)
    # Each engine still hits its own kind.
    assert run(one, system(61) + USER_3)["external_hits"] == SYSTEM_HIT
    assert run(a2, system(62) + USER_3)["external_hits"] == SYSTEM_HIT
    assert_nothing_pinned(node)


def rank_pins(node: Node, rank: int) -> int:
    """Pins held in tensor-parallel rank ``rank``'s namespace."""
    return sum(ns.pinned for ns in node.stats().namespaces if ns.model_id.endswith(f"#tp-2.{rank}"))


def held_rank_pins(node: Node, rank: int) -> int | None:
    """`rank_pins` while a rank is held, or None when the node answers too late.

    A held rank's engine steps empty batches in a busy loop meanwhile (its core and both
    workers spin-wait on each other). On the 2-core CI host that has stalled every
    process for minutes at a time (the kernel logged RCU stalls): no answer in time, or
    no connection at all. That says nothing about the pins, so the wait asks again.
    """
    try:
        return rank_pins(node, rank)
    except ServerUnavailable:  # DeadlineExceeded included
        return None


def test_a_slow_rank_keeps_its_pins_until_it_has_copied(engines, node, faults) -> None:
    """vLLM reports each step's finished loads: rank 0's "done" arrives while rank 1 (held
    here) still copies. Rank 1's pins must stay until rank 1 reports (with them gone,
    another tenant could rewrite the slots under its copy); the answer is exact."""
    a2, ref2 = engines["a2"], engines["ref2"]
    prompt = system(77) + USER_2
    # The held load below needs both ranks' blocks on the node.
    seed(a2, node, system(77) + USER_1, saved=system(77), blocks=SYSTEM_HIT // BLOCK, model=is_tp2)
    a2.command(reset_prefix_cache=True)
    hold, reached = faults / "hold-loads-rank-1", faults / "hold-loads-rank-1.reached"
    reached.unlink(missing_ok=True)
    hold.touch()
    try:
        ticket = a2.send(prompts=[prompt], max_tokens=8)
        wait_until(reached.exists, what="rank 1's load", within=300, tail=a2.tail)
        wait_until(
            lambda: held_rank_pins(node, 0),
            ok=lambda pins: pins == 0,
            what="rank 0's pins to go",
            within=HELD_WAIT,
            interval=0.5,
            tail=a2.tail,
        )
        held = wait_until(
            lambda: held_rank_pins(node, 1), ok=lambda pins: pins is not None, within=HELD_WAIT
        )
        assert held == 3, "rank 1's pins went with rank 0's report"
    finally:
        hold.unlink(missing_ok=True)
    answer = a2.answer(ticket)
    got = {**answer["results"][0], **{k: v for k, v in answer.items() if k != "results"}}
    assert got["external_hits"] == SYSTEM_HIT
    assert got["kvstore_load_errors"] == 0
    want = run(ref2, prompt)
    assert got["tokens"] == want["tokens"]
    assert max_logprob_diff(got, want) <= ENGINE_DIFF
    assert_nothing_pinned(node)
