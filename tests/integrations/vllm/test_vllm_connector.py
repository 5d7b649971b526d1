"""vLLM engines reuse each other's prefixes through a real cache node (real vLLM, no mocks).

One node and four engine processes (started together, reused by every
test): ``ref`` has no connector (the reference outputs), ``a`` and ``b``
use the connector as tenant ``acme``, ``f`` as tenant ``other`` with
``fail_loads`` (every load fails: vLLM must recompute). The engines run
with ``PYTHONHASHSEED`` unset. Every test uses its own system prompts, and
every engine's own prefix cache is emptied before a measured request, so
an external hit can only come from the node. Prompts are token ids; the
block size is 32, so a 100-token system prompt has 3 full blocks (96 tokens).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integrations.vllm.common import (
    BLOCK,
    SYSTEM_HIT,
    USER_1,
    USER_2,
    USER_3,
    assert_nothing_pinned,
    assert_same_output,
    connector,
    max_logprob_diff,
    reference,
    run,
    system,
    tokens,
    wait_saved,
)
from tests.integrations.vllm.engines import Engine, Node, running
from tests.waiting import wait_until

ANSWER_TOKENS = 70
"""Tokens each chat turn generates: over two blocks of answer."""

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def engines(
    vllm_py: str, tiny_model: Path, node: Node, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Engine]]:
    logs = tmp_path_factory.mktemp("engines")
    specs = {
        "ref": None,
        "a": connector(node),
        "b": connector(node),
        "f": connector(node, tenant="other", fail_loads=True),
    }
    started = {
        name: Engine(vllm_py, tiny_model, connector=conn, log_dir=logs, name=name)
        for name, conn in specs.items()
    }
    with running(started) as ready:
        yield ready


def test_same_system_prompt_loads_exactly_its_full_blocks(engines, node) -> None:
    a, b, f, ref = engines["a"], engines["b"], engines["f"], engines["ref"]
    prompt_a, prompt_b = system(1) + USER_1, system(1) + USER_2
    first = run(a, prompt_a)
    assert first["external_hits"] == 0
    wait_saved(node, system(1), SYSTEM_HIT // BLOCK)
    got = run(b, prompt_b)
    # Exactly the system prompt's full blocks: not the partial one, not the user prompt.
    assert got["external_hits"] == SYSTEM_HIT
    assert got["local_hits"] == 0
    # Greedy tokens: those of an engine without the connector.
    cold, local_hit_diff = reference(ref, prompt_b, warm_from=prompt_a)
    assert got["tokens"] == cold["tokens"]
    assert first["tokens"] == run(ref, prompt_a)["tokens"]
    # Logprobs: as tight as vLLM's own prefix-cache hit against a cold run (measured
    # above: exactly equal on this CPU build), against a cold run of the same engine
    # configuration (tenant "other" has nothing cached: f computes the whole prompt).
    own_cold = run(f, prompt_b)
    assert own_cold["external_hits"] == 0
    assert_same_output(got, own_cold, local_hit_diff)
    # Merely enabling a KV connector changes vLLM's float rounding a little (measured
    # here as a few float32 ulps of a logprob, with or without a hit); the hit adds
    # nothing to that.
    engine_diff = max_logprob_diff(own_cold, cold)
    assert engine_diff <= 1e-5
    assert max_logprob_diff(got, cold) <= max(local_hit_diff, engine_diff)
    assert_nothing_pinned(node)


def node_lookups(node: Node) -> int:
    """Lookups the node answered, over every namespace and tenant."""
    return sum(int(t.lookups) for ns in node.stats().namespaces for t in ns.tenants)


def test_a_request_for_prompt_logprobs_computes_its_prompt_and_pins_nothing(engines, node) -> None:
    """Prompt logprobs need every prompt token computed (vLLM's
    ``skip_reading_prefix_cache``): the connector stands aside before the lookup, so
    nothing is looked up or pinned, every prompt logprob comes back, and they equal
    those of an engine without the connector."""
    a, b, ref = engines["a"], engines["b"], engines["ref"]
    prompt = system(9) + USER_2
    run(a, system(9) + USER_1)
    wait_saved(node, system(9), SYSTEM_HIT // BLOCK)  # the node holds the system prompt
    b.command(reset_prefix_cache=True)
    before = node_lookups(node)
    answer = b.command(prompts=[prompt], max_tokens=8, prompt_logprobs=True)
    got = answer["results"][0]
    assert answer["external_hits"] == 0
    assert node_lookups(node) == before, "the connector looked up (and pinned) for nothing"
    want = ref.command(prompts=[prompt], max_tokens=8, prompt_logprobs=True)["results"][0]
    assert len(got["prompt_logprobs"]) == len(prompt) and got["prompt_logprobs"][0] is None
    pairs = zip(got["prompt_logprobs"][1:], want["prompt_logprobs"][1:], strict=True)
    diff = max(abs(x - y) for x, y in pairs)
    assert diff <= 1e-5
    assert got["tokens"] == want["tokens"]
    assert_nothing_pinned(node)
    # The same prompt without prompt logprobs loads the system prompt as usual.
    assert run(b, prompt)["external_hits"] == SYSTEM_HIT


def test_different_system_prompt_gets_no_external_hit(engines, node) -> None:
    a, b, ref = engines["a"], engines["b"], engines["ref"]
    run(a, system(2) + USER_1)
    got = run(b, system(3) + USER_1)  # same user prompt, other system prompt
    assert got["external_hits"] == 0
    assert got["tokens"] == run(ref, system(3) + USER_1)["tokens"]
    assert_nothing_pinned(node)


def test_a_chat_alternating_engines_loads_each_earlier_answer(engines, node) -> None:
    """Turn n+1 repeats turn n's prompt and answer: on the other engine, every full block
    of them (answer included) comes from the node, and the outputs are exact."""
    a, b, ref = engines["a"], engines["b"], engines["ref"]
    history = system(30)
    for turn, (engine, question) in enumerate([(a, USER_1), (b, USER_2), (a, USER_3)]):
        prompt = history + question
        before = stored_blocks(node)
        engine.command(reset_prefix_cache=True)  # only the node can supply a hit
        got = engine.generate([prompt], max_tokens=ANSWER_TOKENS)
        (out,) = got["results"]
        ref.command(reset_prefix_cache=True)
        assert (
            out["tokens"]
            == ref.generate([prompt], max_tokens=ANSWER_TOKENS)["results"][0]["tokens"]
        ), f"turn {turn + 1}"
        # The earlier turn's KV was computed for all its tokens but its last (sampled,
        # never fed back): its full blocks of those, the answer's included, are loaded.
        want = 0 if turn == 0 else (len(history) - 1) // BLOCK * BLOCK
        assert got["external_hits"] == want, f"turn {turn + 1}"
        history = prompt + out["tokens"]
        # The last blocks are stored in the background: wait (bounded) until they are.
        new_blocks = (len(history) - 1) // BLOCK - want // BLOCK
        wait_until(
            lambda: stored_blocks(node) - before >= new_blocks,  # noqa: B023
            what=f"turn {turn + 1}'s {new_blocks} new blocks on the node",
            within=30,
            interval=0.05,
            tail=engine.tail,
        )
    assert_nothing_pinned(node)


def stored_blocks(node: Node) -> int:
    """Blocks tenant acme has stored on the node so far (a counter)."""
    return sum(
        t.stored_blocks for ns in node.stats().namespaces for t in ns.tenants if t.tenant == "acme"
    )


def test_switched_system_prompt_still_hits_until_evicted(engines, node) -> None:
    a, b = engines["a"], engines["b"]
    run(a, system(4) + USER_1)
    run(a, system(5) + USER_1)  # the deployment switched system prompts
    for seed in (4, 5):
        wait_saved(node, system(seed), SYSTEM_HIT // BLOCK)
    assert run(b, system(4) + USER_2)["external_hits"] == SYSTEM_HIT
    assert run(b, system(5) + USER_2)["external_hits"] == SYSTEM_HIT
    # Memory pressure: more new blocks than the namespace holds (64).
    stats = node.stats()
    capacity = max(ns.capacity for ns in stats.namespaces)
    pressure = [tokens(5000 + i, 4 * BLOCK + 1) for i in range(capacity // 4 + 4)]
    a.generate(pressure, max_tokens=1)
    assert run(b, system(4) + USER_3)["external_hits"] == 0
    assert_nothing_pinned(node)


def test_restarted_engine_reuses_what_it_stored(engines, node, vllm_py, tiny_model, tmp_path):
    run(engines["a"], system(6) + USER_1)
    wait_saved(node, system(6), SYSTEM_HIT // BLOCK)
    engines["a"].close()
    engines["a"] = Engine(
        vllm_py, tiny_model, connector=connector(node), log_dir=tmp_path, name="a2"
    ).wait_ready()
    got = run(engines["a"], system(6) + USER_2)
    assert got["external_hits"] == SYSTEM_HIT
    assert got["tokens"] == run(engines["ref"], system(6) + USER_2)["tokens"]
    assert_nothing_pinned(node)


def test_tenants_do_not_share_and_failed_loads_recompute(engines, node) -> None:
    a, f, ref = engines["a"], engines["f"], engines["ref"]
    prompt = system(7) + USER_2
    run(a, system(7) + USER_1)  # acme caches the system prompt
    other = run(f, prompt)
    assert other["external_hits"] == 0, "tenant other saw tenant acme's blocks"
    cold, local_hit_diff = reference(ref, prompt, warm_from=system(7) + USER_1)
    assert other["tokens"] == cold["tokens"]
    wait_saved(node, system(7), SYSTEM_HIT // BLOCK, tenant="other")
    # Now "other" has it too: the hit is reported, every load fails, vLLM recomputes.
    failed = run(f, prompt)
    assert failed["external_hits"] == SYSTEM_HIT
    assert failed["tokens"] == cold["tokens"]
    assert_same_output(failed, other, local_hit_diff)
    assert "failed" in "".join(f.log)
    assert_nothing_pinned(node)


def test_node_down_mid_run_and_at_start_keeps_serving(
    engines, node, vllm_py, tiny_model, tmp_path
) -> None:
    b, ref = engines["b"], engines["ref"]
    run(b, system(8) + USER_1)
    node.kill()
    try:
        got = run(b, system(8) + USER_2)  # mid-run: the node is gone, computed, same output
        assert got["external_hits"] == 0
        assert got["tokens"] == run(ref, system(8) + USER_2)["tokens"]
        # An engine started while the node is unreachable starts and serves.
        b.close()
        b = engines["b"] = Engine(
            vllm_py, tiny_model, connector=connector(node), log_dir=tmp_path, name="b2"
        ).wait_ready()
        got = run(b, system(8) + USER_3)
        assert got["external_hits"] == 0
        assert got["tokens"] == run(ref, system(8) + USER_3)["tokens"]
    finally:
        node.start()  # same port, empty memory
    # The connector leaves a failed node alone for retry_interval (1 s), then
    # reconnects: what it stores from then on is found again.
    deadline = time.monotonic() + 60
    while True:
        run(b, system(9) + USER_1)
        hits = run(b, system(9) + USER_2)["external_hits"]
        if hits == SYSTEM_HIT or time.monotonic() > deadline:
            break
    assert hits == SYSTEM_HIT
    assert_nothing_pinned(node)
