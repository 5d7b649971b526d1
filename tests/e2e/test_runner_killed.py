"""A runner SIGKILLed while holding pins and WRITING slots leaks nothing."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from benchmarks._server import ServerProcess
from tests.e2e.processes import LiveRunner, node_stats, run_ops, wait_for_stats
from tests.e2e.workload import BLOCK_SIZE, system_prompt, user_prompt

pytestmark = pytest.mark.e2e

TTL = 2.0
"""Lease TTL of the runners, in seconds (the SDK renews every TTL / 3, so a loaded
machine may delay a renewal by more than a second without losing the lease)."""


def test_killed_runner_frees_its_pins_and_slots_after_the_lease_ttl(
    kv_node: ServerProcess, live_runners: Callable[..., LiveRunner]
) -> None:
    system = system_prompt("kill")
    prefix = system + user_prompt("kill", 24)  # 6 full blocks, stored below
    longer = prefix + user_prompt("kill-more", 64)  # 4 more blocks: the victim reserves them
    cached, extra = len(prefix) // BLOCK_SIZE, len(longer) // BLOCK_SIZE - len(prefix) // BLOCK_SIZE
    [stored] = run_ops(kv_node.target, [{"op": "store", "tokens": prefix}])
    assert stored["committed"] == cached

    victim = live_runners(
        kv_node.target,
        "hold",
        "--pin-tokens",
        json.dumps(prefix),
        "--reserve-tokens",
        json.dumps(longer),
        lease_ttl=TTL,
    )
    survivor = live_runners(
        kv_node.target,
        "hold",
        "--pin-tokens",
        json.dumps(system),
        "--wait-stdin",
        lease_ttl=TTL,
    )
    held = victim.wait_event("ready")
    kept = survivor.wait_event("ready")
    assert (held["pinned"], held["reserved"], held["mismatches"]) == (cached, extra, 0)
    survivor_pins = len(system) // BLOCK_SIZE
    assert kept["pinned"] == survivor_pins

    def holding(stats) -> bool:
        return (stats.leases, stats.pinned, stats.writing) == (
            2,
            cached + survivor_pins,
            extra,
        )

    assert holding(node_stats(kv_node.target))
    # While the runners live, their SDKs renew the leases: nothing lapses over
    # more than a TTL (a bounded watch, not a sleep: any lapse fails at once).
    watch_until = time.monotonic() + 1.5 * TTL
    while time.monotonic() < watch_until:
        stats = node_stats(kv_node.target)
        assert holding(stats) and stats.leases_expired == 0, stats
        time.sleep(0.1)

    # The victim dies without releasing, aborting or closing its lease.
    assert victim.kill() < 0
    stats = wait_for_stats(
        kv_node.target,
        lambda s: s.pinned == survivor_pins and s.writing == 0,
        timeout=TTL + 8.0,
        what="the dead runner's pins and WRITING slots to be freed",
    )
    assert stats.leases == 1
    assert stats.leases_expired == 1
    [ns] = stats.namespaces
    assert ns.writing == 0
    assert ns.free + ns.quarantined + ns.ready == ns.capacity  # its WRITING slots rest

    # Another runner may now reserve and write the very keys the dead one held.
    store, look = run_ops(
        kv_node.target,
        [{"op": "store", "tokens": longer}, {"op": "lookup", "tokens": longer}],
    )
    assert store["hit"] == cached
    assert store["in_flight"] == 0
    assert store["reserved"] == store["committed"] == extra
    assert store["chain"][cached:] == held["reserved_hashes"]
    assert look["hit_blocks"] == cached + extra
    assert look["mismatches"] == 0  # the half-written block was rewritten in full

    # The live runner was unaffected: its lease and pins held throughout.
    survivor.send("go")
    done = survivor.wait_event("done")
    assert done["mismatches"] == 0
    assert done["released"] == survivor_pins
    assert done["lease_lost"] == 0
    assert survivor.wait() == 0
    stats = wait_for_stats(
        kv_node.target,
        lambda s: (s.leases, s.pinned, s.writing) == (0, 0, 0),
        timeout=5.0,
        what="the survivor's lease to close",
    )
    assert stats.leases_expired == 1
