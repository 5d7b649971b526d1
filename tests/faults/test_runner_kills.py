"""1,000 runners SIGKILLed mid-write, mid-read and mid-startup: nothing leaks, nothing corrupts.

The victims are forks of one pre-imported campaign process
(`tests.faults.kill_worker`), 4 alive at a time, each with its own lease
(TTL 1 s), killed at a random moment of a random operation. Afterwards every
lease must expire, every pin and WRITING slot be freed, the pool must
account for every slot, and every READY block must hold the exact bytes of
its hash (a half-written block is never committed by anyone).

``KVSTORE_FAULT_KILLS`` sets the number of kills (default 1000).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks._server import ServerProcess
from tests.e2e.processes import ROOT, node_stats, wait_for_stats
from tests.faults.kill_worker import CAPACITY_BLOCKS, seed_cache, verify_node

pytestmark = pytest.mark.e2e

KILLS = int(os.environ.get("KVSTORE_FAULT_KILLS", "1000"))
LEASE_TTL = 1.0


def test_random_sigkills_leak_no_slot_pin_or_lease_and_corrupt_nothing(
    kv_node: ServerProcess,
) -> None:
    seeded = seed_cache(kv_node.target)
    assert seeded > 0
    campaign = subprocess.run(
        [
            sys.executable, "-m", "tests.faults.kill_worker", "--target", kv_node.target,
            "--kills", str(KILLS), "--in-flight", "4", "--lease-ttl", str(LEASE_TTL),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=30 + KILLS * 0.2,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert campaign.returncode == 0, campaign.stderr[-4000:]
    report = json.loads(campaign.stdout.strip().splitlines()[-1])
    print("kill campaign:", json.dumps(report, sort_keys=True))
    assert report["kills"] == KILLS
    assert report["failed"] == 0
    assert report["mismatches"] == 0, report  # what the victims read was always right
    phases = report["by_phase"]
    if KILLS >= 200:  # enough kills that each kind of moment is hit
        for where in ("write", "read", "half_written", "hold_pins", "reserve", "lookup"):
            assert phases.get(where, 0) > 0, f"no kill landed in {where}: {phases}"

    # Every dead victim's lease expires (one TTL plus the expiry tick), and
    # with it every pin and WRITING slot.
    stats = wait_for_stats(
        kv_node.target,
        lambda s: (s.leases, s.pinned, s.writing) == (0, 0, 0),
        timeout=LEASE_TTL + 10.0,
        what="every victim's lease to expire",
    )
    [ns] = stats.namespaces
    assert ns.capacity == CAPACITY_BLOCKS
    assert (ns.writing, ns.pinned) == (0, 0)
    assert ns.free + ns.quarantined + ns.ready == ns.capacity  # killed writers' slots rest
    # Victims killed before OpenLease have no lease to expire; all others do.
    assert KILLS - phases.get("connect", 0) <= stats.leases_expired <= KILLS

    # Zero corruption: every READY block (reachable or orphaned) holds its bytes.
    try:
        check = verify_node(kv_node.target)
    except Exception:
        print(kv_node.log_tail(8000))
        raise
    print("verification:", check)
    assert check["mismatches"] == 0
    assert check["ready_blocks"] == ns.ready
    # The node is healthy and leak-free after the verifier closed its lease too.
    after = node_stats(kv_node.target)
    assert (after.leases, after.pinned, after.writing) == (0, 0, 0)
