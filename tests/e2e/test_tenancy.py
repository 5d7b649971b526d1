"""Tenants never share blocks, over the wire, even for identical prompts."""

from __future__ import annotations

import pytest

from benchmarks._server import ServerProcess
from tests.e2e.processes import node_stats, run_ops
from tests.e2e.workload import BLOCK_SIZE, system_prompt, user_prompt

pytestmark = pytest.mark.e2e


def test_identical_prompt_of_another_tenant_gets_no_hits(kv_node: ServerProcess) -> None:
    prompt = system_prompt("tenancy") + user_prompt("tenancy")
    blocks = len(prompt) // BLOCK_SIZE
    [stored_x] = run_ops(kv_node.target, [{"op": "store", "tokens": prompt}], tenant="tenant-x")
    assert stored_x["committed"] == blocks

    by_tokens, by_hashes, forged, stored_y = run_ops(
        kv_node.target,
        [
            {"op": "lookup", "tokens": prompt},
            {"op": "lookup", "tokens": prompt, "hashes": True},
            # Even X's own hashes, sent as they are, reach only Y's scope.
            {"op": "lookup", "tokens": prompt, "raw_hashes": stored_x["chain"]},
            {"op": "store", "tokens": prompt},
        ],
        tenant="tenant-y",
    )
    assert by_tokens["hit_blocks"] == by_hashes["hit_blocks"] == forged["hit_blocks"] == 0
    assert by_tokens["miss_reason"] == "ABSENT"
    assert by_tokens["chain"] != stored_x["chain"], "the tenant salt must change the chain"
    # Y stored its own copy: nothing was a hit for Y.
    assert stored_y["hit"] == 0
    assert stored_y["committed"] == blocks

    [looked_x] = run_ops(kv_node.target, [{"op": "lookup", "tokens": prompt}], tenant="tenant-x")
    assert looked_x["hit_blocks"] == blocks
    assert looked_x["hit_hashes"] == stored_x["chain"]
    assert looked_x["mismatches"] == 0

    stats = node_stats(kv_node.target)
    per_tenant = {t.tenant: t for ns in stats.namespaces for t in ns.tenants}
    assert per_tenant["tenant-x"].resident_blocks == blocks
    assert per_tenant["tenant-y"].resident_blocks == blocks
    assert per_tenant["tenant-y"].hit_blocks == 0
    assert per_tenant["tenant-x"].hit_blocks == blocks
