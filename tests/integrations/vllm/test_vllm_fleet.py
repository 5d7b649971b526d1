"""Engines on different hosts reuse each other's prefixes through the cluster (real vLLM).

Two cache nodes share one private redis-server, each with its own pool folder
(as two hosts would): engine ``a`` saves into node 1, engine ``b`` looks up
node 2, which finds the rest of the prefix on node 1 in the Redis directory and
fetches it (`docs/cluster.md`, "Peer fetch") before answering; ``b`` then loads
it as local blocks. ``other`` is another tenant on node 2 and ``ref`` an engine
without the connector (the reference outputs). Engine ``a`` also publishes
vLLM's own KV events, which node 1 ingests (`docs/events.md`), so the prefix
query names ``a`` as a holder too. The last test kills node 1.
"""

from __future__ import annotations

import json
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
    connector,
    max_logprob_diff,
    run,
    system,
)
from tests.integrations.vllm.engines import Engine, Node, published, running
from tests.redis.server import REDIS_SERVER, RedisServer, free_port
from tests.waiting import wait_until

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


def cluster_node(workdir: Path, redis_url: str, node_id: str, *more: str) -> Node:
    flags = (
        "--redis-url", redis_url, "--node-id", node_id, "--redis-key-prefix", "fleet",
        "--cluster-token", "fleet-secret", "--heartbeat-seconds", "0.5",
        "--node-ttl-seconds", str(NODE_TTL), "--peer-fetch-timeout", "10", *more,
    )  # fmt: skip
    return Node(workdir, namespace_capacity="2MiB", extra_args=flags).start()


@pytest.fixture(scope="module")
def events_port() -> int:
    """Engine ``a``'s KV-event PUB port."""
    return free_port()


@pytest.fixture(scope="module")
def nodes(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_model: Path, events_port: int
) -> Iterator[tuple[Node, Node]]:
    # Node 1 ingests engine a's KV events, naming the model as the engine serves it.
    source = {"name": "a", "endpoint": f"tcp://127.0.0.1:{events_port}", "tenant": "acme"}
    engines = json.dumps([{**source, "model_id": str(tiny_model)}])
    one = cluster_node(
        tmp_path_factory.mktemp("host-1"), redis_url, "host-1", "--engine-kv-events", engines
    )
    two = cluster_node(tmp_path_factory.mktemp("host-2"), redis_url, "host-2")
    try:
        yield one, two
    finally:
        one.stop()
        two.stop()


@pytest.fixture(scope="module")
def engines(
    vllm_py: str, tiny_model: Path, nodes: tuple[Node, Node], tmp_path_factory, events_port: int
) -> Iterator[dict[str, Engine]]:
    one, two = nodes
    logs = tmp_path_factory.mktemp("fleet-engines")
    events = {"enable_kv_cache_events": True, "publisher": "zmq"}
    specs = {
        "a": connector(one, lookup_timeout=LOOKUP_TIMEOUT),
        "b": connector(two, lookup_timeout=LOOKUP_TIMEOUT),
        "other": connector(two, lookup_timeout=LOOKUP_TIMEOUT, tenant="globex"),
        "ref": None,
    }
    started = {
        name: Engine(vllm_py, tiny_model, connector=spec, log_dir=logs, name=name)
        for name, spec in specs.items()
        if name != "a"
    }
    started["a"] = Engine(
        vllm_py, tiny_model, connector=specs["a"], log_dir=logs, name="a",
        kv_events_config={**events, "endpoint": f"tcp://*:{events_port}"},
    )  # fmt: skip
    with running(started) as ready:
        yield ready


def ready_blocks(node: Node) -> int:
    return sum(int(ns.ready) for ns in node.stats().namespaces)


def save_on_host_1(engine: Engine, redis_url: str, prompt: list[int]) -> None:
    """Run ``prompt`` on ``engine`` (node 1) and wait until node 1 has published its full
    blocks in the directory (saves and directory writes happen in the background)."""
    before = published(redis_url, "host-1")
    run(engine, prompt)
    wait_until(
        lambda: published(redis_url, "host-1") - before >= len(prompt) // BLOCK,
        what="node 1 publishing the prompt's blocks",
        within=60,
        interval=0.05,
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


def test_the_prefix_query_names_both_hosts_and_the_engine(
    engines, nodes, redis_url, tiny_model
) -> None:
    from kvstore.client import SyncClient

    prompt = system(84) + USER_1
    save_on_host_1(engines["a"], redis_url, prompt)
    run(engines["b"], system(84) + USER_2)  # node 2 fetches the system prompt's blocks
    full = len(prompt) // BLOCK

    def holders() -> dict[tuple[str, str], int]:
        with SyncClient(nodes[1].target, tenant="acme", timeout=10) as client:
            answer = client.query_prefix(model=str(tiny_model), tokens=prompt)
        return {(h.node_id, h.engine): h.matched_blocks for h in answer.holders}

    # Engine a's own cache holds the whole prompt's full blocks (its KV events, ingested
    # by node 1); node 1 the same (saved); node 2 the system prompt's (fetched).
    want = {("host-1", "a"): full, ("host-1", ""): full, ("host-2", ""): SYSTEM_HIT // BLOCK}
    wait_until(
        lambda: holders() == want,
        what="node 1 to index engine a's blocks",
        within=30,
        interval=0.05,
    )
    with SyncClient(nodes[1].target, tenant="globex", timeout=10) as client:
        assert not client.query_prefix(model=str(tiny_model), tokens=prompt).holders


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


def test_a_peer_that_sends_another_blocks_bytes_is_a_miss_and_the_output_is_exact(
    engines, nodes, redis_url
) -> None:
    """Node 1's slot of block 1 holds block 0's bytes (a bookkeeping bug on the holder, or
    its memory): node 2's fetch checks every block against its writer's checksum, keeps
    block 0, refuses block 1 and the rest (a miss, logged naming tier and holder); engine
    b loads one block and computes the rest, exactly."""
    from kvstore.api.wire import layout_from_proto
    from kvstore.client import SyncClient

    a, b, ref = engines["a"], engines["b"], engines["ref"]
    one, two = nodes
    prompt = system(85) + USER_1
    save_on_host_1(a, redis_url, prompt)
    stats = max(one.stats().namespaces, key=lambda n: n.ready)
    with SyncClient(one.target, tenant="acme", timeout=10.0) as client:
        ns = client.register_namespace(
            stats.model_id, layout_from_proto(stats.layout), timeout=10.0
        )
        hit = client.lookup(ns, prompt, pin=True, timeout=10.0)
        assert hit.hit_blocks == len(prompt) // BLOCK
        views = hit.numpy_views()
        views[1][...] = views[0]  # block 1's slot now holds block 0's bytes
        client.release(hit, timeout=10.0)
    got = run(b, system(85) + USER_2)
    assert got["external_hits"] == BLOCK  # block 0 fetched and loaded, no more
    want = run(ref, system(85) + USER_2)
    assert got["tokens"] == want["tokens"]
    assert max_logprob_diff(got, want) <= ENGINE_DIFF
    assert two.server is not None
    log = two.server.log_tail()
    assert "checksum mismatch" in log and "tier peer" in log and "host-1" in log
    assert_nothing_pinned(one)
    assert_nothing_pinned(two)


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
