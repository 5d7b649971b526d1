"""With auth on, every command that reads a node takes a token (#34).

The node requires a token on every RPC once a tenants file is configured,
Stats, ListBlocks and WatchEvents included: a tenant's token sees that
tenant's namespaces and counters, the admin token everything. Read commands
take ``--token``, else ``KVSTORE_TOKEN``, else ``KVSTORE_ADMIN_TOKEN``; admin
verbs ``--admin-token`` (or ``--token``), else ``KVSTORE_ADMIN_TOKEN``, else
``KVSTORE_TOKEN`` (docs/operations.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from tests.cli.conftest import (
    ADMIN_TOKEN,
    BLOCK_SIZE,
    LiveNode,
    kvstore,
    start_node,
    stop_node,
    store_prompt,
)
from tests.tenants import ALICE_TOKEN, BOB_TOKEN, MODEL, OTHER_MODEL, TENANTS_TOML, bearer

PROMPT = list(range(100, 100 + 3 * BLOCK_SIZE))
"""Alice's 3 cached blocks."""

READS = (
    ("status", "--json"),
    ("namespaces", "--json"),
    ("tenants", "--json"),
    ("blocks", MODEL, "--json"),
    ("tree", MODEL, "--json"),
    ("watch", "--duration", "0.5"),
    ("query", "--model", MODEL, "--tokens-file", "-", "--json"),
)
"""Every command that reads a node (`nodes` reads Redis, never a node)."""


@pytest.fixture(scope="module")
def auth_node(tmp_path_factory) -> Iterator[LiveNode]:
    folder = tmp_path_factory.mktemp("auth-pools")
    tenants = folder / "tenants.toml"
    tenants.write_text(TENANTS_TOML)
    node = start_node(folder, tenants_file=str(tenants))
    try:
        store_prompt(node, MODEL, PROMPT, bearer(ALICE_TOKEN))
        store_prompt(node, OTHER_MODEL, list(range(BLOCK_SIZE)), bearer(BOB_TOKEN))
        yield node
    finally:
        stop_node(node)


def run(node: LiveNode, *args: str, env: dict[str, str] | None = None):
    prompt = " ".join(map(str, PROMPT)) if args[0] == "query" else ""
    return kvstore(*args, "-t", node.target, env=env, input=prompt)


def models(node: LiveNode, *args: str, env: dict[str, str] | None = None) -> set[str]:
    r = run(node, "namespaces", "--json", *args, env=env)
    assert r.code == 0, r.stderr
    return {row["model"] for row in r.json()}


def test_without_a_token_each_read_command_says_how_to_give_one(auth_node):
    for args in READS:
        r = run(auth_node, *args)
        assert r.code == 4, (args, r.stderr)
        assert r.stderr.startswith("kvstore: refused (UNAUTHENTICATED)"), (args, r.stderr)
        assert "pass --token or set KVSTORE_TOKEN" in r.stderr, (args, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and r.stdout == "", (args, r.stderr)


def test_a_tenants_token_reads_that_tenants_view(auth_node):
    for args in READS:
        r = run(auth_node, *args, "--token", ALICE_TOKEN)
        assert r.code == 0, (args, r.stderr)
    assert models(auth_node, "--token", ALICE_TOKEN) == {MODEL}
    r = run(auth_node, "blocks", MODEL, "--json", env={"KVSTORE_TOKEN": ALICE_TOKEN})
    assert r.code == 0 and r.json()["total"] == 3, r.stderr
    r = run(auth_node, "query", "--model", MODEL, "--tokens-file", "-", "--json",
            env={"KVSTORE_TOKEN": ALICE_TOKEN})  # fmt: skip
    assert r.code == 0 and r.json()["longest_matched"] == len(PROMPT), r.stderr
    rows = run(auth_node, "tenants", "--json", env={"KVSTORE_TOKEN": ALICE_TOKEN}).json()
    assert {row["tenant"] for row in rows} == {"alice"}


def test_read_commands_prefer_the_flag_then_kvstore_token_then_the_admin_token(auth_node):
    everything = {MODEL, OTHER_MODEL}
    assert models(auth_node, env={"KVSTORE_ADMIN_TOKEN": ADMIN_TOKEN}) == everything
    both = {"KVSTORE_TOKEN": ALICE_TOKEN, "KVSTORE_ADMIN_TOKEN": ADMIN_TOKEN}
    assert models(auth_node, env=both) == {MODEL}
    assert models(auth_node, "--token", ADMIN_TOKEN, env=both) == everything


def test_admin_verbs_prefer_the_admin_token_and_take_token_as_an_alias(auth_node):
    r = run(auth_node, "evict", OTHER_MODEL, "--blocks", "1", "--yes")
    assert r.code == 4 and "UNAUTHENTICATED" in r.stderr, r.stderr
    assert "pass --admin-token or set KVSTORE_ADMIN_TOKEN" in r.stderr, r.stderr
    both = {"KVSTORE_TOKEN": ALICE_TOKEN, "KVSTORE_ADMIN_TOKEN": ADMIN_TOKEN}
    r = run(auth_node, "evict", OTHER_MODEL, "--blocks", "1", "--yes", "--json", env=both)
    assert r.code == 0 and r.json()["evicted"] == 1, r.stderr
    r = run(auth_node, "evict", MODEL, "--blocks", "1", "--yes", "--token", ALICE_TOKEN)
    assert r.code == 4 and "PERMISSION_DENIED" in r.stderr, r.stderr
    r = run(auth_node, "evict", MODEL, "--blocks", "1", "--yes", "--token", ADMIN_TOKEN)
    assert r.code == 0, r.stderr


def test_what_the_node_answers_without_a_token_as_the_docs_say(auth_node):
    """docs/operations.md "Tokens": every read RPC needs one; Ping does not."""
    channel, stub = auth_node.stub()
    with channel:
        assert stub.Ping(pb.PingRequest(payload=b"up"), timeout=5).payload == b"up"
        for call, request in (
            (stub.Stats, pb.StatsRequest()),
            (stub.ListBlocks, pb.ListBlocksRequest(namespace_id="0" * 16)),
            (stub.QueryPrefix, pb.QueryPrefixRequest(model=MODEL, packed_hashes=b"\0" * 32)),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=5)
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
