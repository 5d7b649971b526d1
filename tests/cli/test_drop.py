"""``kvstore drop``: refused while blocks are pinned, --force drops, memory returns."""

from __future__ import annotations

from tests.cli.conftest import ADMIN_TOKEN, kvstore, populate, start_node, stop_node


def test_drop_refused_while_pinned_then_forced(tmp_path):
    node = start_node(tmp_path)
    try:
        populate(node)  # leaves one block pinned
        env = {"KVSTORE_ADMIN_TOKEN": ADMIN_TOKEN}
        r = kvstore("drop", "demo-model", "--yes", "-t", node.target)
        assert r.code == 4 and "UNAUTHENTICATED" in r.stderr
        r = kvstore("drop", "demo-model", "-t", node.target, env=env, input="n\n")
        assert r.code == 1 and "not confirmed" in r.stderr
        r = kvstore("drop", "demo-model", "--yes", "-t", node.target, env=env)
        assert r.code == 1 and "FAILED_PRECONDITION" in r.stderr and "force" in r.stderr
        assert "Traceback" not in r.stderr
        r = kvstore("drop", "demo-model", "--force", "--yes", "--json", "-t", node.target, env=env)
        assert r.code == 0, r.stderr
        doc = r.json()
        assert doc["namespace"] == node.namespace and doc["pins_dropped"] == 1
        assert doc["removed"] == 10 and doc["freed_bytes"] > 0
        status = kvstore("status", "--json", "-t", node.target).json()
        assert status["used_blocks"] == 0
        r = kvstore("drop", "demo-model", "--yes", "-t", node.target, env=env)
        assert r.code == 1 and "not a namespace" in r.stderr
    finally:
        stop_node(node)
