"""Options before the command: ``--target`` (``KVSTORE_TARGET``), ``--version``."""

from __future__ import annotations

import kvstore
from tests.cli.conftest import free_port
from tests.cli.conftest import kvstore as run


def test_version():
    r = run("--version")
    assert r.code == 0, r.stderr
    assert r.stdout.strip() == f"kvstore {kvstore.__version__}"


def test_a_global_target_reaches_every_command(live_node):
    for args in (("status", "--json"), ("namespaces", "--json"), ("tenants", "--json"),
                 ("tree", "demo-model", "--json")):  # fmt: skip
        r = run("--target", live_node.target, *args)
        assert r.code == 0, (args, r.stderr)
    assert run("-t", live_node.target, "status", "--json").json()["node_id"] == "cli-node"


def test_the_command_target_wins_then_the_global_one_then_the_env(live_node):
    dead = f"127.0.0.1:{free_port()}"
    r = run("--target", dead, "status", "--json", "--target", live_node.target)
    assert r.code == 0, r.stderr
    r = run("--target", live_node.target, "status", "--json", env={"KVSTORE_TARGET": dead})
    assert r.code == 0, r.stderr
    r = run("status", "--json", env={"KVSTORE_TARGET": live_node.target})
    assert r.code == 0, r.stderr
    r = run("--target", dead, "status", env={"KVSTORE_TARGET": live_node.target})
    assert r.code == 3 and f"cannot reach the kvstore node at {dead}" in r.stderr
