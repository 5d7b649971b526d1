"""The connector never stores or serves wrong KV, and never stalls vLLM (real engines).

One node and four engine processes shared by the module: ``ref`` without
the connector (the reference outputs), ``a`` with the connector (a short
lease and lookup timeout; the test connector of `faulty`, whose faults the
tests switch on: held loads, pins leaked while a load is sent), ``f``
whose loads all fail, and ``p`` with a KV cache so small that a batch
preempts. ``a``, ``f`` and ``p`` are one tenant, so they share blocks.
Every fault is real: failed loads, an engine stopped with SIGSTOP past its
lease while another tenant overwrites the pool, a node stopped with
SIGSTOP under a stream of requests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.api.wire import layout_from_proto
from kvstore.client import SyncClient
from tests.integrations.vllm.common import (
    BLOCK,
    FAULTS_ENV,
    USER_1,
    USER_2,
    assert_nothing_pinned,
    connector,
    max_logprob_diff,
    run,
    seed,
    system,
    tokens,
    wait_saved,
)
from tests.integrations.vllm.engines import ROOT, Engine, Node, running, verifying_node
from tests.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(900)]

LEASE_TTL = 3.0
LOOKUP_TIMEOUT = 1.0
ENGINE_DIFF = 1e-5
"""Logprob difference between an engine with the connector and one without, measured
(test_vllm_connector): merely enabling a connector moves float32 rounding a few ulps."""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """The shared node of `conftest`, with full verification (`verifying_node`)."""
    with verifying_node(tmp_path_factory.mktemp("node")) as node:
        yield node


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder whose files switch engine ``a``'s faults on (`faulty`)."""
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def hold_file(faults: Path) -> Path:
    return faults / "hold-loads"


@pytest.fixture(scope="module")
def engines(
    vllm_py: str,
    tiny_model: Path,
    node: Node,
    faults: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Engine]]:
    logs = tmp_path_factory.mktemp("fault-engines")
    quick = {"lease_ttl": LEASE_TTL, "lookup_timeout": LOOKUP_TIMEOUT}
    specs: dict[str, dict[str, Any]] = {
        "ref": {"connector": None},
        "a": {
            "connector": connector(node, **quick),
            "faulty": True,
            "env": {FAULTS_ENV: str(faults)},
        },
        "f": {"connector": connector(node, fail_loads=True)},
        # 24 blocks of 32 tokens: a batch of 32 prompts of ~5 blocks each preempts.
        "p": {"connector": connector(node), "num_gpu_blocks_override": 24, "max_model_len": 512},
    }
    started = {
        name: Engine(vllm_py, tiny_model, log_dir=logs, name=name, **spec)
        for name, spec in specs.items()
    }
    with running(started) as ready:
        yield ready


def assert_exact(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tokens"] == want["tokens"]
    assert max_logprob_diff(got, want) <= ENGINE_DIFF


def test_a_failed_load_never_poisons_the_cache(engines, node) -> None:
    a, f, ref = engines["a"], engines["f"], engines["ref"]
    head = tokens(2000, 5 * BLOCK)
    prompt = head + USER_1  # 5 full blocks
    seed(
        a, node, head[: 2 * BLOCK] + USER_2, saved=head, blocks=2
    )  # the node holds the first 2 blocks only
    failed = run(f, prompt)  # hits 2 blocks, the load fails: vLLM recomputes them
    assert failed["external_hits"] == 2 * BLOCK
    assert "failed" in "".join(f.log)
    want = run(ref, prompt)
    assert_exact(failed, want)
    # Whatever f saved of this prompt was computed after the recompute: a third
    # engine loading all 5 blocks from the node gives the reference output.
    assert_nothing_pinned(node)
    wait_saved(node, prompt, 5)
    got = run(a, prompt)
    assert got["external_hits"] == 5 * BLOCK
    assert_exact(got, want)
    assert_nothing_pinned(node)


def fill_pool(node: Node, tenant: str) -> int:
    """Store as many random blocks as the namespace holds, under another tenant."""
    stats = node.stats()
    ns_stats = max(stats.namespaces, key=lambda n: n.capacity)
    layout = layout_from_proto(ns_stats.layout)
    rng = np.random.default_rng(7)
    with SyncClient(node.target, tenant=tenant, timeout=10.0) as client:
        ns = client.register_namespace(ns_stats.model_id, layout, timeout=10.0)
        n = int(ns_stats.capacity)
        ids = [int(t) for t in rng.integers(3, 1024, size=n * layout.block_size)]
        blocks = rng.standard_normal((n, *layout.block_shape)).astype(np.float32)
        result = client.store(ns, ids, blocks, timeout=30.0)
    return result.committed


def test_an_engine_stalled_past_its_lease_recomputes(engines, node, hold_file) -> None:
    a, ref = engines["a"], engines["ref"]
    prompt = system(20) + USER_2
    seed(
        a, node, system(20) + USER_1, saved=system(20), blocks=3
    )  # the node holds the system prompt
    a.command(reset_prefix_cache=True)
    hold_file.touch()
    reached = Path(str(hold_file) + ".reached")
    reached.unlink(missing_ok=True)
    try:
        ticket = a.send(prompts=[prompt], max_tokens=8)
        # The lookup pinned the blocks and the load is about to copy them: stall here.
        wait_until(reached.exists, what="the load", within=120, interval=0.05)
        a.pause()
        try:
            # The lease runs out (no renewals), the pins drop, another tenant
            # overwrites every slot of the namespace.
            wait_until(
                lambda: node.stats().pinned == 0,
                what="the lease to expire",
                within=4 * LEASE_TTL + 10,
                interval=0.05,
            )
            assert fill_pool(node, "filler") > 0
        finally:
            a.resume()
    finally:
        hold_file.unlink(missing_ok=True)
    answer = a.answer(ticket)
    got = {**answer["results"][0], **{k: v for k, v in answer.items() if k != "results"}}
    assert got["external_hits"] == 3 * BLOCK  # the hit was counted, then not used
    assert "not surely held" in "".join(a.log)
    assert_exact(got, run(ref, prompt))
    assert_nothing_pinned(node, within=2 * LEASE_TTL + 5)


def test_a_hung_node_never_stalls_the_engine(engines, node) -> None:
    a, ref = engines["a"], engines["ref"]
    prompts = [system(30) + tokens(300 + i, 20) for i in range(4)]
    want = ref.generate(prompts)["results"]
    run(a, system(31) + USER_1)  # connected, with a lease
    node.pause()
    try:
        got = a.generate(prompts)["results"]
    finally:
        node.resume()
    slowest_ref = max(r["wall"] for r in want)
    for g, w in zip(got, want, strict=True):
        # At most one lookup timeout on the node, then computed as without a cache.
        assert g["wall"] <= LOOKUP_TIMEOUT + 1.0 + 3 * slowest_ref, (g["wall"], slowest_ref)
        assert_exact(g, w)
    # Once the node answers again, the engine's pins and writes drain within a lease TTL.
    assert_nothing_pinned(node, within=LEASE_TTL + 10)


def test_a_preempting_batch_is_exact_and_leaves_nothing_pinned(engines, node) -> None:
    p, a, ref = engines["p"], engines["a"], engines["ref"]
    prompts = [system(40 + i % 4) + tokens(500 + i, 20 + i % 7) for i in range(32)]
    for s in (40, 41):  # two of the four system prompts are on the node already
        run(a, system(s) + USER_1)
    want = ref.command(prompts=prompts, max_tokens=48, batch=True)
    got = p.command(prompts=prompts, max_tokens=48, batch=True)
    assert got["preemptions"] > 0, "the small KV cache did not preempt"
    assert got["external_hits"] > 0
    for g, w in zip(got["results"], want["results"], strict=True):
        assert g["tokens"] == w["tokens"]
    assert_nothing_pinned(node)
    # The batch's answers were saved as their blocks filled, preempted or not: the
    # requests that ran last (the preempted ones, resumed last; the newest on the
    # node) are continued on another engine, which loads their answers' blocks.
    follow = [q + g["tokens"] + USER_2 for q, g in zip(prompts, got["results"], strict=True)][-4:]
    loaded = 0
    for prompt in follow:
        g, w = run(a, prompt), run(ref, prompt)
        assert_exact(g, w)
        loaded += g["external_hits"]
    answered = [(len(q) - len(USER_2) - 1) // BLOCK * BLOCK for q in follow]
    assert loaded == sum(answered), (loaded, answered)
    assert_nothing_pinned(node)


def engine_namespace(node: Node) -> tuple[str, Any]:
    """The model id and layout of the engines' namespace on the node."""
    ns_stats = max(node.stats().namespaces, key=lambda n: n.capacity)
    return ns_stats.model_id, layout_from_proto(ns_stats.layout)


def test_a_slot_overwritten_under_a_load_is_recomputed(engines, node, faults) -> None:
    """The pins of a sent load are dropped (a bookkeeping bug, injected) and another tenant
    overwrites every slot before the worker copies: the stamps prove the copy wrong, the
    blocks are load errors, vLLM recomputes them, and the counters say so."""
    a, ref = engines["a"], engines["ref"]
    prompt = system(50) + USER_2
    seed(
        a, node, system(50) + USER_1, saved=system(50), blocks=3
    )  # the node holds the system prompt
    a.command(reset_prefix_cache=True)
    hold, leak = faults / "hold-loads", faults / "leak-pins"
    reached = faults / "hold-loads.reached"
    reached.unlink(missing_ok=True)
    hold.touch()
    leak.touch()
    try:
        ticket = a.send(prompts=[prompt], max_tokens=8)
        wait_until(reached.exists, what="the load", within=120, interval=0.05, tail=a.tail)
        # The lease is alive (pins_until holds): only the stamps can tell.
        wait_until(
            lambda: node.stats().pinned == 0, what="the leaked pins to go", within=30, interval=0.05
        )
        assert fill_pool(node, "filler") > 0
    finally:
        leak.unlink(missing_ok=True)
        hold.unlink(missing_ok=True)
    answer = a.answer(ticket)
    got = {**answer["results"][0], **{k: v for k, v in answer.items() if k != "results"}}
    assert got["external_hits"] == 3 * BLOCK  # the hit was counted, then not used
    assert got["kvstore_load_errors"] == 3 and got["kvstore_load_moved"] == 3
    assert "no longer hold the blocks the lookup found" in "".join(a.log)
    assert_exact(got, run(ref, prompt))
    assert_nothing_pinned(node)


def test_a_bit_flipped_in_a_committed_block_is_recomputed(engines, node) -> None:
    """One bit of a cached block flips in the pool (bad memory, a stray write): with full
    verification the engine's load finds the bytes are not their writer's, reports the
    block as a load error, and vLLM recomputes it."""
    a, ref = engines["a"], engines["ref"]
    prompt = system(60) + USER_2
    seed(
        a, node, system(60) + USER_1, saved=system(60), blocks=3
    )  # the node holds the system prompt
    model, layout = engine_namespace(node)
    with SyncClient(node.target, tenant="acme", timeout=10.0) as client:
        ns = client.register_namespace(model, layout, timeout=10.0)
        assert ns.verify_loads
        hit = client.lookup(ns, prompt, pin=True, timeout=10.0)
        assert hit.hit_blocks == 3
        block = hit.numpy_views()[1].reshape(-1).view(np.uint8)
        block[3] ^= 0x40  # an exponent bit of the first float32: a large change
        client.release(hit, timeout=10.0)
    got = run(a, prompt)
    assert got["external_hits"] == 3 * BLOCK
    assert got["kvstore_checksum_failed"] == 1 and got["kvstore_load_errors"] >= 1
    assert "do not match their writer's checksum" in "".join(a.log)
    assert_exact(got, run(ref, prompt))
    assert_nothing_pinned(node)
    # The engine reported the block with its release and the node dropped it (its
    # recomputed bytes may be saved again): the next load never fails on it again.
    again = run(a, prompt)
    assert again["kvstore_checksum_failed"] == 0 and again["kvstore_load_errors"] == 0
    assert_exact(again, run(ref, prompt))


WRITER = """
import sys, time, numpy as np
from kvstore.api.wire import layout_from_proto
from kvstore.client import SyncClient
target, model, prompt = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
with SyncClient(target, tenant="acme", timeout=10.0, lease_ttl=3.0) as c:
    stats = next(n for n in c.stats(timeout=10.0).namespaces if n.model_id == model)
    layout = layout_from_proto(stats.layout)
    ns = c.register_namespace(model, layout, timeout=10.0)
    def block(i):
        if i == 2:  # two blocks written, the third half-way: killed here
            print("@@HALF", flush=True)
            time.sleep(600)
        return np.full(layout.block_shape, 7.0 + i, np.float32)  # not the model's KV
    c.store(ns, prompt, block, timeout=600.0)
"""


def test_a_writer_killed_half_way_is_never_served(engines, node) -> None:
    """A runner SIGKILLed while it writes the blocks of a prompt (torn writes, wrong bytes
    under the right hashes) never committed them: an engine asking for that prompt finds
    nothing, computes it, and answers exactly."""
    a, ref = engines["a"], engines["ref"]
    prompt = system(80) + USER_1
    model, _ = engine_namespace(node)
    with subprocess.Popen(
        [sys.executable, "-c", WRITER, node.target, model, ",".join(map(str, prompt))],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ) as writer:
        try:
            assert writer.stdout is not None
            assert writer.stdout.readline().strip() == "@@HALF"
            assert node.stats().writing > 0
        finally:
            writer.kill()
    got = run(a, prompt)
    assert got["external_hits"] == 0
    assert_exact(got, run(ref, prompt))
    assert_nothing_pinned(node, within=4 * LEASE_TTL + 10)  # the dead writer's lease expires


def test_sigterm_with_a_load_in_flight_leaks_nothing_and_saves_nothing_wrong(
    engines, node, faults
) -> None:
    """SIGTERM to an engine whose load is copying: the copy fails once the connector is
    closed, nothing stays pinned past the lease, and another engine loading the same
    prompt answers exactly. (Last in the module: engine ``a`` is gone after it.)"""
    a, p, ref = engines["a"], engines["p"], engines["ref"]
    prompt = system(90) + USER_2
    seed(
        a, node, system(90) + USER_1, saved=system(90), blocks=3
    )  # the node holds the system prompt
    a.command(reset_prefix_cache=True)
    hold, reached = faults / "hold-loads", faults / "hold-loads.reached"
    reached.unlink(missing_ok=True)
    hold.touch()
    try:
        a.send(prompts=[prompt], max_tokens=8)
        wait_until(reached.exists, what="the load", within=120, interval=0.05, tail=a.tail)
        os.killpg(a.proc.pid, signal.SIGTERM)
        time.sleep(1.0)  # the connector closes while the load is held
    finally:
        hold.unlink(missing_ok=True)
    a.proc.wait(120)
    assert_nothing_pinned(node, within=4 * LEASE_TTL + 10)
    got = run(p, prompt)
    assert got["external_hits"] == 3 * BLOCK
    assert_exact(got, run(ref, prompt))
