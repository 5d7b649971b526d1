"""Tables read at 80 columns (a pipe, an ssh session): no line wider, no cell cut to "…",
whole ids and hash prefixes, and sizes in binary units (``kvstore nodes`` printed raw bytes).

Rich reads the width from ``COLUMNS`` when stdout is not a terminal, as here.
"""

from __future__ import annotations

import re

import pytest

from tests.cli.conftest import kvstore, start_node, stop_node
from tests.cli.docs import documented_node_fields
from tests.redis.server import REDIS_SERVER, RedisServer
from tests.waiting import wait_until

NARROW = {"COLUMNS": "80"}


def check_fits(text: str) -> list[str]:
    """The non-blank lines of ``text``, each checked to fit 80 columns and to cut nothing."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    assert lines, "no output"
    too_wide = [line for line in lines if len(line) > 80]
    assert not too_wide, "\n".join(too_wide)
    assert "…" not in text and "..." not in text.replace("... ", ""), text
    return lines


def words(text: str) -> set[str]:
    return set(re.split(r"[\s:,()]+", text))


def test_status_namespaces_tenants_fit(live_node):
    for args in (("status",), ("namespaces",), ("tenants",),
                 ("tenants", "--namespace", "demo-model")):  # fmt: skip
        r = kvstore(*args, "-t", live_node.target, env=NARROW)
        assert r.code == 0, (args, r.stderr)
        check_fits(r.stdout)
        if args[0] != "status":
            assert live_node.namespace in words(r.stdout), (args, r.stdout)
            assert "demo-model" in words(r.stdout), (args, r.stdout)
    r = kvstore("tenants", "-t", live_node.target, env=NARROW)
    row = next(line for line in check_fits(r.stdout) if line.startswith("default"))
    assert row.split() == ["default", "5", "64", "8", "88.9%", "1", "0", "10"]


def test_blocks_and_tree_fit(live_node):
    doc = kvstore("blocks", "demo-model", "--json", "-t", live_node.target).json()
    r = kvstore("blocks", "demo-model", "-t", live_node.target, env=NARROW)
    assert r.code == 0, r.stderr
    check_fits(r.stdout)
    assert {b["hash"][:12] for b in doc["blocks"]} <= words(r.stdout)  # whole 12-digit prefixes
    assert live_node.namespace in words(r.stdout) and "default" in words(r.stdout)
    r = kvstore("tree", "demo-model", "-t", live_node.target, env=NARROW)
    assert r.code == 0, r.stderr
    check_fits(r.stdout)
    assert "shared by 3" in r.stdout


@pytest.fixture
def cluster_node(tmp_path):
    if REDIS_SERVER is None:
        pytest.skip("needs redis-server on PATH")
    redis = RedisServer(tmp_path / "redis").start()
    try:
        node = start_node(
            tmp_path, redis_url=redis.url, redis_key_prefix="kvcli", heartbeat_seconds=0.2,
            node_ttl_seconds=5.0,
        )  # fmt: skip
        try:
            yield redis.url, node
        finally:
            stop_node(node)
    finally:
        redis.stop()


def test_nodes_prints_human_sizes_at_80_columns(cluster_node):
    url, node = cluster_node
    env = {"KVSTORE_REDIS_URL": url, "KVSTORE_REDIS_KEY_PREFIX": "kvcli"}
    rows = wait_until(lambda: kvstore("nodes", "--json", env=env).json(), what="the node's entry")
    assert rows[0]["capacity_bytes"] == 1 << 20
    assert set(rows[0]) == set(documented_node_fields())
    r = kvstore("nodes", env={**env, **NARROW})
    assert r.code == 0, r.stderr
    lines = check_fits(r.stdout)
    row = next(line for line in lines if line.startswith("cli-node"))
    assert "1.0 MiB" in row and str(1 << 20) not in r.stdout
    assert node.target in row.split()
