"""The three prefix-caching cases of docs/hashing.md, over the wire, between runner processes."""

from __future__ import annotations

import pytest

from benchmarks._server import ServerProcess
from tests.e2e.processes import namespace_stats, node_stats, run_ops
from tests.e2e.workload import BLOCK_BYTES, BLOCK_SIZE, system_prompt, user_prompt

pytestmark = pytest.mark.e2e


def test_same_system_prompt_reuses_its_full_blocks(kv_node: ServerProcess) -> None:
    system = system_prompt("assistant")  # 72 tokens: 4 full blocks, 8 tokens into the 5th
    first, second = system + user_prompt(1), system + user_prompt(2)
    [stored] = run_ops(kv_node.target, [{"op": "store", "tokens": first}])
    assert stored["committed"] == len(first) // BLOCK_SIZE

    # Another runner, sending hashes this time, then tokens: the same answer.
    by_hashes, by_tokens = run_ops(
        kv_node.target,
        [
            {"op": "lookup", "tokens": second, "hashes": True},
            {"op": "lookup", "tokens": second},
        ],
    )
    full = len(system) // BLOCK_SIZE
    for looked in (by_hashes, by_tokens):
        assert looked["hit_blocks"] == full
        assert looked["hit_hashes"] == stored["chain"][:full]
        assert looked["mismatches"] == 0
    assert by_tokens["hit_tokens"] == full * BLOCK_SIZE
    assert by_tokens["query_tokens"] == len(second)

    # Storing the second prompt writes only what was missing.
    [again] = run_ops(kv_node.target, [{"op": "store", "tokens": second}])
    assert again["hit"] == full
    assert again["reserved"] == again["committed"] == len(second) // BLOCK_SIZE - full
    assert sorted(int(i) for i in again["written"]) == list(range(full, len(second) // BLOCK_SIZE))


def test_different_system_prompt_shares_nothing_after_the_first_difference(
    kv_node: ServerProcess,
) -> None:
    user = user_prompt("same question")
    system_a = system_prompt("a")
    system_b = list(system_a)
    system_b[BLOCK_SIZE + 3] += 1  # differs inside block 1 only
    prompt_a, prompt_b = system_a + user, system_b + user
    # Blocks 2.. hold identical tokens in both prompts...
    assert prompt_a[2 * BLOCK_SIZE :] == prompt_b[2 * BLOCK_SIZE :]

    [stored] = run_ops(kv_node.target, [{"op": "store", "tokens": prompt_a}])
    other, unrelated = run_ops(
        kv_node.target,
        [
            {"op": "lookup", "tokens": prompt_b},
            {"op": "lookup", "tokens": system_prompt("c") + user},
        ],
    )
    # ...yet only block 0, before the difference, is shared: every later key chains
    # through block 1.
    assert other["hit_blocks"] == 1
    assert other["hit_hashes"] == stored["chain"][:1]
    assert other["miss_reason"] == "ABSENT"
    assert other["mismatches"] == 0
    assert all(a != b for a, b in zip(stored["chain"][1:], other["chain"][1:], strict=True))
    assert unrelated["hit_blocks"] == 0

    [stored_b] = run_ops(kv_node.target, [{"op": "store", "tokens": prompt_b}])
    assert stored_b["hit"] == 1
    assert stored_b["committed"] == len(prompt_b) // BLOCK_SIZE - 1


def test_session_switching_system_prompt_keeps_old_blocks_until_lru_evicts(
    kv_node: ServerProcess,
) -> None:
    # A namespace of 16 blocks; each prompt is 72 + 24 tokens = 6 full blocks.
    small = {"model": "e2e-session", "capacity_bytes": 16 * BLOCK_BYTES}
    prompt_a = system_prompt("session-a") + user_prompt("a", 24)
    prompt_b = system_prompt("session-b") + user_prompt("b", 24)
    prompt_c = system_prompt("session-c") + user_prompt("c", 24)
    blocks = len(prompt_a) // BLOCK_SIZE
    assert blocks == 6

    # The session starts on system prompt A, switches to B, then asks about A again.
    store_a, store_b, look_a = run_ops(
        kv_node.target,
        [
            {"op": "store", "tokens": prompt_a},
            {"op": "store", "tokens": prompt_b},
            {"op": "lookup", "tokens": prompt_a},
        ],
        **small,
    )
    assert store_a["committed"] == store_b["committed"] == blocks
    assert look_a["hit_blocks"] == blocks, "switching system prompt erased the old blocks"
    assert look_a["mismatches"] == 0
    stats = node_stats(kv_node.target)
    [session_ns] = [ns for ns in stats.namespaces if ns.model_id == "e2e-session"]
    assert session_ns.capacity == 16
    assert (session_ns.ready, session_ns.free, session_ns.evictions) == (12, 4, 0)

    # Memory pressure: C needs 6 slots, 4 are free. The least recently used
    # blocks go, leaves first: B's last two (A was touched by the lookup).
    store_c, look_a, look_b, look_c = run_ops(
        kv_node.target,
        [
            {"op": "store", "tokens": prompt_c},
            {"op": "lookup", "tokens": prompt_a},
            {"op": "lookup", "tokens": prompt_b},
            {"op": "lookup", "tokens": prompt_c},
        ],
        **small,
    )
    assert store_c["committed"] == blocks
    assert store_c["no_room"] == 0
    assert look_a["hit_blocks"] == blocks
    assert look_b["hit_blocks"] == blocks - 2
    assert look_b["hit_hashes"] == store_b["chain"][: blocks - 2]
    assert look_c["hit_blocks"] == blocks
    assert look_a["mismatches"] == look_b["mismatches"] == look_c["mismatches"] == 0
    session_ns = namespace_stats(node_stats(kv_node.target), session_ns.namespace_id)
    assert (session_ns.ready, session_ns.free, session_ns.evictions) == (16, 0, 2)
