"""Engines on different hosts reuse each other's prefixes through the cluster (real vLLM).

Two cache nodes share one private redis-server, each with its own pool folder
(as two hosts would): engine ``a`` saves into node 1, engine ``b`` looks up
node 2, which finds the rest of the prefix on node 1 in the Redis directory and
fetches it (`docs/cluster.md`, "Peer fetch") before answering; ``b`` then loads
it as local blocks. ``other`` is another tenant on node 2 and ``ref`` an engine
without the connector (the reference outputs). The last test kills node 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.integrations.vllm.common import (
    BLOCK,
    SYSTEM_HIT,
    USER_1,
    USER_2,
    USER_3,
    assert_nothing_pinned,
    connector,
    max_logprob_diff,
    run,
    system,
    wait_for,
)
from tests.integrations.vllm.engines import Engine, Node, running
from tests.redis.server import REDIS_SERVER, RedisServer

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server on PATH"),
]

LOOKUP_TIMEOUT = 30.0
"""Four vLLM processes share this 2-core host; a lookup includes the peer fetch."""
ENGINE_DIFF = 1e-5
"""Logprob difference between an engine with the connector and one without (float32 ulps)."""
NODE_TTL = 5.0
"""Seconds a killed node stays in the directory: long enough that the kill test's lookup
finds node 1 still listed and its fetch fails (the path under test), not merely absent."""


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


def cluster_node(workdir: Path, redis_url: str, node_id: str) -> Node:
    flags = (
        "--redis-url", redis_url, "--node-id", node_id, "--redis-key-prefix", "fleet",
        "--cluster-token", "fleet-secret", "--heartbeat-seconds", "0.5",
        "--node-ttl-seconds", str(NODE_TTL), "--peer-fetch-timeout", "10",
    )  # fmt: skip
    return Node(workdir, namespace_capacity="2MiB", extra_args=flags).start()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[tuple[Node, Node]]:
    one = cluster_node(tmp_path_factory.mktemp("host-1"), redis_url, "host-1")
    two = cluster_node(tmp_path_factory.mktemp("host-2"), redis_url, "host-2")
    try:
        yield one, two
    finally:
        one.stop()
        two.stop()


@pytest.fixture(scope="module")
def engines(
    vllm_py: str, tiny_model: Path, nodes: tuple[Node, Node], tmp_path_factory
) -> Iterator[dict[str, Engine]]:
    one, two = nodes
    logs = tmp_path_factory.mktemp("fleet-engines")
    specs = {
        "a": connector(one, lookup_timeout=LOOKUP_TIMEOUT),
        "b": connector(two, lookup_timeout=LOOKUP_TIMEOUT),
        "other": connector(two, lookup_timeout=LOOKUP_TIMEOUT, tenant="globex"),
        "ref": None,
    }
    started = {
        name: Engine(vllm_py, tiny_model, connector=spec, log_dir=logs, name=name)
        for name, spec in specs.items()
    }
    with running(started) as ready:
        yield ready


def ready_blocks(node: Node) -> int:
    return sum(int(ns.ready) for ns in node.stats().namespaces)


def published(redis_url: str, node_id: str) -> int:
    """Blocks the Redis directory lists under ``node_id`` (every namespace and tenant)."""
    with redis.Redis.from_url(redis_url, socket_timeout=5) as r:
        return sum(int(r.scard(key)) for key in r.scan_iter(match=f"*:n:{node_id}"))


def save_on_host_1(engine: Engine, redis_url: str, prompt: list[int]) -> None:
    """Run ``prompt`` on ``engine`` (node 1) and wait until node 1 has published its full
    blocks in the directory (saves and directory writes happen in the background)."""
    before = published(redis_url, "host-1")
    run(engine, prompt)
    wait_for(
        "node 1 publishing the prompt's blocks",
        lambda: published(redis_url, "host-1") - before >= len(prompt) // BLOCK,
        within=60,
        tail=engine.tail,
    )


def test_an_engine_loads_a_prefix_another_host_computed(engines, nodes, redis_url) -> None:
    a, b, ref = engines["a"], engines["b"], engines["ref"]
    one, two = nodes
    before = ready_blocks(two)
    save_on_host_1(a, redis_url, system(80) + USER_1)
    assert ready_blocks(two) == before  # node 2 has none of them
    got = run(b, system(80) + USER_2)
    assert got["external_hits"] == SYSTEM_HIT  # fetched from node 1, loaded from node 2
    want = run(ref, system(80) + USER_2)
    assert got["tokens"] == want["tokens"]
    assert max_logprob_diff(got, want) <= ENGINE_DIFF
    assert ready_blocks(two) > before  # the fetched blocks are node 2's own now
    assert_nothing_pinned(one)
    assert_nothing_pinned(two)


def test_a_prompt_nobody_served_hits_nothing(engines, nodes) -> None:
    got = run(engines["b"], system(81) + USER_1)
    assert got["external_hits"] == 0
    assert got["tokens"] == run(engines["ref"], system(81) + USER_1)["tokens"]
    assert_nothing_pinned(nodes[1])


def test_another_tenant_never_gets_the_blocks(engines, nodes, redis_url) -> None:
    save_on_host_1(engines["a"], redis_url, system(82) + USER_1)
    got = run(engines["other"], system(82) + USER_2)
    assert got["external_hits"] == 0  # neither node credits acme's blocks to globex
    assert got["tokens"] == run(engines["ref"], system(82) + USER_2)["tokens"]
    # The owner's own engine on node 2 still gets them.
    assert run(engines["b"], system(82) + USER_3)["external_hits"] == SYSTEM_HIT
    assert_nothing_pinned(nodes[1])


def test_a_killed_peer_is_a_miss_and_the_output_is_exact(engines, nodes, redis_url) -> None:
    a, b, ref = engines["a"], engines["b"], engines["ref"]
    one, two = nodes
    save_on_host_1(a, redis_url, system(83) + USER_1)
    one.kill()  # still in the directory for up to NODE_TTL: node 2's fetch fails
    got = run(b, system(83) + USER_2)
    assert got["external_hits"] == 0
    want = run(ref, system(83) + USER_2)
    assert got["tokens"] == want["tokens"]
    assert max_logprob_diff(got, want) <= ENGINE_DIFF
    assert_nothing_pinned(two)
    # Node 2 still serves what it fetched before node 1 died.
    assert run(b, system(80) + USER_3)["external_hits"] == SYSTEM_HIT
    assert_nothing_pinned(two)
