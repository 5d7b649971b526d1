"""Every command that takes a namespace takes an id, a model id, or a unique prefix of either.

The node here has two namespaces, ``demo-model`` and ``demo-model-b``: ``demo``
names both (ambiguous), ``demo-model`` names the first exactly, and
``demo-model-`` only the second.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.v1 import kvstore_pb2 as pb
from tests.cli.conftest import (
    BLOCK_SIZE,
    LAYOUT,
    LiveNode,
    kvstore,
    populate,
    start_node,
    stop_node,
)
from tests.replies import entries_of
from tests.stand_ins import stand_in_checksums


@pytest.fixture(scope="module")
def two_ns(tmp_path_factory):
    node = start_node(tmp_path_factory.mktemp("names-pools"))
    try:
        populate(node)
        channel, stub = node.stub()
        with channel:
            node.extra["b"] = stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(model_id="demo-model-b", layout=LAYOUT), timeout=5
            ).namespace_id
        yield node
    finally:
        stop_node(node)


def test_tenants_takes_a_model_id(two_ns):
    r = kvstore("tenants", "--namespace", "demo-model", "--json", "-t", two_ns.target)
    assert r.code == 0, r.stderr
    [row] = r.json()
    assert row["namespace"] == two_ns.namespace and row["lookups"] == 5
    by_prefix = kvstore("tenants", "--namespace", two_ns.namespace[:6], "--json",
                        "-t", two_ns.target)  # fmt: skip
    assert by_prefix.json() == r.json()


def test_tenants_with_an_unknown_namespace_fails_clearly(two_ns):
    for args in (("--json",), ()):
        r = kvstore("tenants", "--namespace", "no-such-model", *args, "-t", two_ns.target)
        assert r.code == 1, (r.stdout, r.stderr)
        assert r.stdout == ""
        assert "'no-such-model' is not a namespace of this node" in r.stderr
        assert f"{two_ns.namespace} (demo-model)" in r.stderr  # what exists
        assert f"{two_ns.extra['b']} (demo-model-b)" in r.stderr
        assert "Traceback" not in r.stderr


def test_an_ambiguous_name_lists_the_candidates(two_ns):
    for args in (("tenants", "--namespace", "demo"), ("blocks", "demo"), ("tree", "demo")):
        r = kvstore(*args, "-t", two_ns.target)
        assert r.code == 1, (args, r.stdout, r.stderr)
        assert "'demo' is ambiguous" in r.stderr
        assert two_ns.namespace in r.stderr and two_ns.extra["b"] in r.stderr


def test_a_unique_model_prefix_names_a_namespace(two_ns):
    r = kvstore("blocks", "demo-model-", "--json", "-t", two_ns.target)
    assert r.code == 0, r.stderr
    assert r.json()["namespace"] == two_ns.extra["b"] and r.json()["total"] == 0
    r = kvstore("tree", "demo-model", "--json", "-t", two_ns.target)  # exact beats prefix
    assert r.code == 0, r.stderr
    assert r.json()["namespace"] == two_ns.namespace


def _store_one(node: LiveNode, namespace: str, first_token: int) -> list[bytes]:
    channel, stub = node.stub()
    with channel:
        lid = stub.OpenLease(pb.OpenLeaseRequest(), timeout=5).lease_id
        tokens = list(range(first_token, first_token + BLOCK_SIZE))
        res = stub.Reserve(
            pb.ReserveRequest(namespace_id=namespace, lease_id=lid, tokens=tokens), timeout=5
        )
        hashes = [e.hash for e in entries_of(res)]
        stub.Commit(
            pb.CommitRequest(
                namespace_id=namespace,
                lease_id=lid,
                packed_hashes=b"".join(hashes),
                packed_checksums=stand_in_checksums(b"".join(hashes)),
            ),
            timeout=5,
        )
        stub.CloseLease(pb.CloseLeaseRequest(lease_id=lid), timeout=5)
    return hashes


def test_watch_takes_a_model_id(two_ns):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "watch", "--namespace", "demo-model-b", "--json",
         "--count", "1", "--duration", "30", "-t", two_ns.target],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # printed once the subscription is in place
        assert line.startswith("watching events"), line + proc.stderr.read()
        _store_one(two_ns, two_ns.namespace, 400)  # the other namespace: filtered out
        hashes = _store_one(two_ns, two_ns.extra["b"], 500)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    event = json.loads(out.splitlines()[0])
    assert event["namespace"] == two_ns.extra["b"]
    assert event["hashes"] == [h.hex() for h in hashes]


def test_watch_with_an_unknown_namespace_fails_clearly(two_ns):
    r = kvstore("watch", "--namespace", "nope", "--duration", "5", "-t", two_ns.target)
    assert r.code == 1 and "'nope' is not a namespace of this node" in r.stderr
    assert "watching events" not in r.stderr
