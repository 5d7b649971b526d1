"""Eight runner processes store and look up overlapping prompts at once."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks._server import ServerProcess
from tests.e2e.processes import ROOT, RUNNER_TIMEOUT, runner_argv, wait_for_stats
from tests.e2e.workload import BLOCK_BYTES

pytestmark = pytest.mark.e2e

RUNNERS = 8
DURATION = 6.0
"""Seconds each runner loops (started together, so they overlap)."""
CAPACITY_BLOCKS = 192
"""Small enough that the runners evict each other's blocks all the time."""


def test_concurrent_runners_read_only_correct_bytes_and_leak_nothing(
    kv_node: ServerProcess,
) -> None:
    options = {"model": "e2e-concurrent", "capacity_bytes": CAPACITY_BLOCKS * BLOCK_BYTES}
    processes = [
        subprocess.Popen(
            runner_argv(
                kv_node.target,
                "worker",
                "--seed",
                str(seed),
                "--duration",
                str(DURATION),
                **options,
            ),
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(RUNNERS)
    ]
    reports = []
    try:
        for proc in processes:
            out, err = proc.communicate(timeout=DURATION + RUNNER_TIMEOUT)
            assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{err}"
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in processes:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    total = {key: sum(r[key] for r in reports) for key in reports[0]}
    assert total["mismatches"] == 0, total
    assert total["wrong_hash"] == 0, total
    assert all(r["iterations"] > 0 for r in reports), reports
    assert total["hit_blocks"] > 0, total
    assert total["verified"] == total["hit_blocks"]
    assert total["stored_blocks"] > CAPACITY_BLOCKS, "expected the runners to evict"

    # Every runner exited and closed its lease: nothing pinned, nothing WRITING,
    # and every slot is either free or holds a READY block.
    stats = wait_for_stats(
        kv_node.target,
        lambda s: (s.leases, s.pinned, s.writing) == (0, 0, 0),
        timeout=5.0,
        what="every lease to be closed",
    )
    assert stats.leases_expired == 0
    [ns] = [n for n in stats.namespaces if n.model_id == "e2e-concurrent"]
    assert ns.capacity == CAPACITY_BLOCKS
    assert (ns.writing, ns.pinned) == (0, 0)
    assert ns.free + ns.ready == ns.capacity
    assert ns.evictions > 0
