"""Every read command as a subprocess against a live node: --json output and exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli.live import event_json, event_line
from kvstore.v1 import kvstore_pb2 as pb
from tests.cli.conftest import BLOCK_SIZE, free_port, kvstore
from tests.replies import entries_of
from tests.stand_ins import stand_in_checksums

ROOT = Path(__file__).resolve().parents[2]


def test_status_json(live_node):
    r = kvstore("status", "--json", "--target", live_node.target)
    assert r.code == 0, r.stderr
    doc = r.json()
    assert doc["node_id"] == "cli-node" and doc["target"] == live_node.target
    assert doc["used_blocks"] == 10 and doc["capacity_blocks"] == 16  # one arena so far
    assert doc["pinned_blocks"] == 1 and doc["leases"] == 1
    assert (doc["hit_tokens"], doc["miss_tokens"]) == (64, 8)
    assert doc["hit_rate_tokens"] == pytest.approx(64 / 72)
    assert doc["hit_rate_blocks"] == pytest.approx(16 / 18)
    assert doc["uptime_seconds"] > 0 and doc["capacity_bytes"] == 1 << 20


def test_status_table_uses_env_target(live_node):
    r = kvstore("status", env={"KVSTORE_TARGET": live_node.target})
    assert r.code == 0, r.stderr
    assert "cli-node" in r.stdout and "88.9% of tokens" in r.stdout
    assert "1 block (1 pin)" in r.stdout  # never "1 blocks (1 pins)" (#34)


def test_namespaces_and_tenants(live_node):
    r = kvstore("namespaces", "--json", "-t", live_node.target)
    assert r.code == 0, r.stderr
    [ns] = r.json()
    assert ns["namespace"] == live_node.namespace and ns["model"] == "demo-model"
    assert ns["block_size"] == BLOCK_SIZE and ns["used_blocks"] == 10
    r = kvstore("tenants", "--json", "-t", live_node.target)
    assert r.code == 0, r.stderr
    [t] = r.json()
    assert t["tenant"] == "default" and t["lookups"] == 5 and t["miss_absent"] == 1
    assert t["resident_blocks"] == 10


def test_blocks_pages(live_node):
    r = kvstore("blocks", "demo-model", "--json", "--page-size", "4", "-t", live_node.target)
    assert r.code == 0, r.stderr
    first = r.json()
    assert first["total"] == 10 and len(first["blocks"]) == 4 and first["next_page_token"]
    block = first["blocks"][0]
    assert {"hash", "parent", "depth", "hits", "pins", "state", "last_used", "tenant"} <= set(block)
    assert block["state"] == "ready" and block["last_used"] > 1e9
    r = kvstore("blocks", live_node.namespace, "--json", "--page-size", "4",
                "--page", first["next_page_token"], "-t", live_node.target)  # fmt: skip
    second = r.json()
    assert len(second["blocks"]) == 4
    assert not {b["hash"] for b in first["blocks"]} & {b["hash"] for b in second["blocks"]}


def test_tree_collapses_the_shared_system_prompt(live_node):
    r = kvstore("tree", "demo-model", "--json", "-t", live_node.target)
    assert r.code == 0, r.stderr
    doc = r.json()
    assert (doc["blocks"], doc["runs"], doc["shared_runs"]) == (10, 5, 1)
    system, lone = doc["roots"]
    assert (system["blocks"], system["tokens"], system["requests"]) == (3, 12, 3)
    assert system["hits"] == 9  # three lookups hit its three blocks
    assert [c["tokens"] for c in system["children"]] == [8, 8, 8]
    assert all(c["start_token"] == 12 and c["requests"] == 1 for c in system["children"])
    assert (lone["tokens"], lone["pins"], lone["children"]) == (4, 1, [])
    text = kvstore("tree", "demo-model", "-t", live_node.target)
    assert text.code == 0 and "shared by 3" in text.stdout
    # The lone run: 1 block, 1 hit, 1 pin, in the singular (#34).
    assert "4 tokens (1 block from token 0) · 1 request · 1 hit · 1 pin" in text.stdout


def test_unknown_namespace_is_a_clear_error(live_node):
    r = kvstore("tree", "no-such-model", "-t", live_node.target)
    assert r.code == 1 and "not a namespace" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [("status",), ("namespaces",), ("tree", "x"), ("watch",)])
def test_node_down_is_a_message_not_a_traceback(args):
    target = f"127.0.0.1:{free_port()}"
    r = kvstore(*args, "--target", target)
    assert r.code == 3, (r.stdout, r.stderr)
    assert f"cannot reach the kvstore node at {target}" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_watch_streams_events(live_node):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "watch", "--json", "--count", "1",
         "--duration", "30", "-t", live_node.target],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # printed once the subscription is in place
        assert line.startswith("watching events"), line
        channel, stub = live_node.stub()
        with channel:
            lid = stub.OpenLease(pb.OpenLeaseRequest(), timeout=5).lease_id
            tokens = list(range(300, 300 + BLOCK_SIZE))
            res = stub.Reserve(pb.ReserveRequest(namespace_id=live_node.namespace, lease_id=lid,
                                                 tokens=tokens), timeout=5)  # fmt: skip
            hashes = [e.hash for e in entries_of(res)]
            packed = b"".join(hashes)
            stub.Commit(pb.CommitRequest(namespace_id=live_node.namespace, lease_id=lid,
                                         packed_hashes=packed,
                                         packed_checksums=stand_in_checksums(packed)),
                        timeout=5)  # fmt: skip
            stub.CloseLease(pb.CloseLeaseRequest(lease_id=lid), timeout=5)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    import json

    event = json.loads(out.splitlines()[0])
    assert event["kind"] == "stored" and event["namespace"] == live_node.namespace
    assert event["hashes"] == [h.hex() for h in hashes] and event["node_id"] == "cli-node"
    assert event["tier"] == "memory"  # no disk tier on this node


def test_watch_shows_each_events_tier():
    disk = event_json(pb.Event(kind=pb.EVENT_KIND_STORED, hashes=[b"\x01" * 32], tier="disk"))
    older = event_json(pb.Event(kind=pb.EVENT_KIND_REMOVED))  # a node older than Event.tier
    joined = event_json(pb.Event(kind=pb.EVENT_KIND_NODE_JOINED, node_id="node-b"))
    assert (disk["tier"], older["tier"], joined["tier"]) == ("disk", "memory", "")
    assert " stored   disk   " in event_line(disk) and "1 block 010101010101" in event_line(disk)
    assert " removed  memory " in event_line(older)
    assert " node_joined - " in event_line(joined)


def test_nodes_without_redis_says_so():
    r = kvstore("nodes")
    assert r.code == 5 and "no Redis configured" in r.stderr and "Traceback" not in r.stderr


def test_bench_quick_runs_the_core_benchmark():
    r = kvstore("bench", "core", "--quick", "--json", "--dir", str(ROOT), timeout=60)
    assert r.code == 0, r.stderr
    doc = r.json()
    core = doc["benchmarks"]["bench_core"]
    assert doc["quick"] and core["ok"] and doc["failed"] == []
    assert core["numbers"]["hashing.tokens"] == 8192
    assert core["numbers"]["metadata.metadata_bytes_per_block"] > 0
    table = kvstore("bench", "core", "--quick", "--dir", str(ROOT), timeout=60)
    assert table.code == 0 and "bench_core" in table.stdout


def test_bench_unknown_benchmark():
    r = kvstore("bench", "nope", "--dir", str(ROOT))
    assert r.code == 1 and "no such benchmark bench_nope" in r.stderr
