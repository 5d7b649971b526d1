"""Admin commands: refused without the admin token, confirmed unless --yes."""

from __future__ import annotations

import pytest

from tests.cli.conftest import ADMIN_TOKEN, kvstore, populate, start_node, stop_node


@pytest.fixture(scope="module")
def admin_node(tmp_path_factory):
    node = start_node(tmp_path_factory.mktemp("admin-pools"))
    try:
        populate(node)
        yield node
    finally:
        stop_node(node)


def used(node) -> int:
    return kvstore("status", "--json", "-t", node.target).json()["used_blocks"]


def test_refused_without_or_with_a_wrong_token(admin_node):
    r = kvstore("clear", "demo-model", "--yes", "-t", admin_node.target)
    assert r.code == 4 and "UNAUTHENTICATED" in r.stderr and "Traceback" not in r.stderr
    r = kvstore("evict", "demo-model", "--blocks", "1", "--yes", "--admin-token", "wrong",
                "-t", admin_node.target)  # fmt: skip
    assert r.code == 4 and "PERMISSION_DENIED" in r.stderr
    assert used(admin_node) == 10


def test_confirmation_declined_changes_nothing(admin_node):
    r = kvstore("clear", "demo-model", "-t", admin_node.target, input="n\n",
                env={"KVSTORE_ADMIN_TOKEN": ADMIN_TOKEN})  # fmt: skip
    assert r.code == 1 and "not confirmed" in r.stderr
    r = kvstore(
        "clear", "demo-model", "-t", admin_node.target, env={"KVSTORE_ADMIN_TOKEN": ADMIN_TOKEN}
    )  # fmt: skip  (no input: EOF)
    assert r.code == 1 and used(admin_node) == 10


def test_evict_then_clear_with_the_token(admin_node):
    r = kvstore("evict", "demo-model", "--blocks", "2", "--json", "--admin-token", ADMIN_TOKEN,
                "-t", admin_node.target, input="y\n")  # fmt: skip
    assert r.code == 0, r.stderr
    assert r.json()["evicted"] == 2 and used(admin_node) == 8
    r = kvstore("clear", "demo-model", "--yes", "--json", "-t", admin_node.target,
                env={"KVSTORE_ADMIN_TOKEN": ADMIN_TOKEN})  # fmt: skip
    assert r.code == 0, r.stderr
    assert r.json() == {
        "namespace": admin_node.namespace, "removed": 7, "kept_pinned": 1, "kept_writing": 0,
    }  # fmt: skip
    assert used(admin_node) == 1
