"""One runner process writes blocks into the node's pool; another reads them back."""

from __future__ import annotations

import pytest

from benchmarks._server import ServerProcess
from tests.e2e.processes import node_stats, run_ops
from tests.e2e.workload import BLOCK_SIZE, system_prompt, user_prompt

pytestmark = pytest.mark.e2e


def test_runner_b_reads_exactly_the_bytes_runner_a_stored(kv_node: ServerProcess) -> None:
    system = system_prompt("shared")
    prompt_a = system + user_prompt("a")
    prompt_b = system + user_prompt("b")
    shared_blocks = len(system) // BLOCK_SIZE  # 4: the 5th block mixes in the user prompt

    [stored] = run_ops(kv_node.target, [{"op": "store", "tokens": prompt_a}])
    assert stored["server_chain_matches"], "client-side hashing disagrees with the node"
    blocks_a = len(prompt_a) // BLOCK_SIZE
    assert stored["reserved"] == stored["committed"] == blocks_a

    [looked] = run_ops(
        kv_node.target, [{"op": "lookup", "tokens": prompt_b, "pin": True, "torch": True}]
    )
    # B found A's system-prompt blocks, pinned them, and compared them inside its own
    # process, through its own mapping (numpy and torch views), with the expected bytes.
    assert looked["pinned"]
    assert looked["hit_blocks"] == shared_blocks
    assert looked["hit_tokens"] == shared_blocks * BLOCK_SIZE
    assert looked["miss_reason"] == "ABSENT"
    assert looked["verified"] == shared_blocks
    assert looked["mismatches"] == 0
    assert looked["torch_mismatches"] == 0
    assert looked["wrong_hash"] == 0
    assert looked["released"] == shared_blocks
    # And what B read is what A wrote: same keys, same bytes.
    assert looked["hit_hashes"] == stored["chain"][:shared_blocks]
    assert looked["chain"][shared_blocks] != stored["chain"][shared_blocks]
    assert looked["digests"] == [stored["written"][str(i)] for i in range(shared_blocks)]

    stats = node_stats(kv_node.target)
    assert (stats.leases, stats.pinned, stats.writing) == (0, 0, 0)
