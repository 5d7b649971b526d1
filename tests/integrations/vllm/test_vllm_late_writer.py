"""A writer stalled past its lease and quarantine, then resumed, under real vLLM engines.

Issue 40's fault through the connector: writer A (`tests.faults.late_writer`,
a process of its own) reserves a slot in the engines' namespace and is
SIGSTOPped where its copy begins. Its 1 s lease expires, the slot's
quarantine (0.5 s on this node) ends, engine ``a`` saves a system prompt
into the namespace's three slots (A's among them), and then A is continued:
its copy lands on one of ``a``'s committed blocks. Engines that load the
prompt afterwards must never use A's bytes: with the default settings their
loads check every block against its writer's checksum, the block is a load
error (recomputed), the count is on vLLM's /metrics, and the engine reports
it with its release, so the node drops it and no later load fails on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.api.wire import layout_from_proto
from tests.integrations.vllm.common import (
    BLOCK,
    SYSTEM_HIT,
    USER_1,
    USER_2,
    assert_nothing_pinned,
    connector,
    max_logprob_diff,
    run,
    system,
    wait_saved,
)
from tests.integrations.vllm.engines import ROOT, Engine, Node, running
from tests.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(900)]

BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4
"""One block of the tiny Llama: K and V, 2 layers, 32 tokens, 2 heads of 32, float32."""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node whose namespace holds exactly the system prompt's 3 blocks, and whose write
    quarantine is half a second (the test waits it out)."""
    node = Node(
        tmp_path_factory.mktemp("node"),
        namespace_capacity=str(3 * BLOCK_BYTES),
        extra_args=("--write-quarantine-seconds", "0.5"),
    ).start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="module")
def engines(
    vllm_py: str, tiny_model: Path, node: Node, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Engine]]:
    logs = tmp_path_factory.mktemp("engines")
    started = {
        name: Engine(vllm_py, tiny_model, connector=conn, log_dir=logs, name=name)
        for name, conn in {"ref": None, "a": connector(node), "b": connector(node)}.items()
    }
    with running(started) as ready:
        yield ready


def paused_writer(
    node: Node, model: str, layout: object, tokens: list[int]
) -> subprocess.Popen[str]:
    """Writer A with a slot of the engines' namespace reserved, stopped before its copy."""
    writer = subprocess.Popen(
        [
            sys.executable, "-m", "tests.faults.late_writer", "--target", node.target,
            "--tokens", ",".join(map(str, tokens)), "--model", model,
            "--layout", json.dumps(dataclasses.asdict(layout)),  # type: ignore[call-overload]
        ],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert writer.stdout is not None
    writer.stdout.readline()  # its slot
    assert writer.stdout.readline() == "ready\n", writer.stderr.read() if writer.stderr else ""
    os.kill(writer.pid, signal.SIGSTOP)
    return writer


def test_a_late_write_into_a_saved_prefix_never_reaches_an_engine(engines, node) -> None:
    a, b, ref = engines["a"], engines["b"], engines["ref"]
    # The connectors register the engines' namespace as they start.
    stats = wait_until(
        lambda: next((n for n in node.stats().namespaces if n.model_id.startswith("vllm:")), None),
        what="the engines' namespace",
        within=60,
        interval=0.2,
    )
    model, layout = stats.model_id, layout_from_proto(stats.layout)
    writer = paused_writer(node, model, layout, USER_2[:BLOCK] + USER_1[: BLOCK - len(USER_2)])
    try:
        # A's lease expires and the quarantine ends: its slot is free again, and a's save
        # of the system prompt needs every slot of the namespace.
        def saved_all() -> bool:
            run(a, system(7) + USER_1)
            wait_saved(node, system(7), SYSTEM_HIT // BLOCK, within=10)
            return True

        wait_until(
            lambda: _quietly(saved_all), what="a's save into every slot", within=60, interval=0.5
        )
        os.kill(writer.pid, signal.SIGCONT)  # A's copy lands on one of a's blocks
        out, err = writer.communicate(timeout=30)
        assert "wrote" in out, err
        got = run(b, system(7) + USER_2)
        assert got["external_hits"] == SYSTEM_HIT
        assert got["kvstore_checksum_failed"] == 1  # vLLM's /metrics: the late write seen
        assert got["kvstore_load_errors"] >= 1
        cold = run(ref, system(7) + USER_2)
        assert got["tokens"] == cold["tokens"]  # 0 wrong outputs
        assert max_logprob_diff(got, cold) <= 1e-3
        assert_nothing_pinned(node)
        # Engines keep loading the prefix; b reported the block with its release and
        # the node dropped it, so no later load fails on it again.
        again = run(b, system(7) + USER_2)
        assert again["kvstore_checksum_failed"] == 0 and again["kvstore_load_errors"] == 0
        assert again["tokens"] == cold["tokens"]
        assert max_logprob_diff(again, cold) <= 1e-3
    finally:
        if writer.poll() is None:
            os.kill(writer.pid, signal.SIGCONT)
            writer.kill()
            writer.wait(10)


def _quietly(attempt: object) -> bool:
    try:
        return bool(attempt())  # type: ignore[operator]
    except AssertionError:
        return False
