"""benchmarks/bench_peer.py still runs: a --quick run prints its figures, bytes checked.

Figures are not checked (benchmarks are measured, never asserted); what is
checked is that both readers got the right bytes, each over the transport
it was meant to use.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.redis.server import REDIS_SERVER

pytest.importorskip("nixl._api", reason="needs the nixl package (pip install kvstore[nixl])")
pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server on PATH")

ROOT = Path(__file__).resolve().parents[2]


def test_a_quick_run_prints_nixl_grpc_and_memcpy_figures() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_peer", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    for transport in ("nixl", "grpc"):
        assert result[transport]["bytes_ok"] is True, result  # never a wrong block
        # Not the other transport; the result carries the nodes' log lines when not.
        assert result[transport]["fetches_by_transport"] >= 1, result
    assert result["memcpy"]["gb_per_s"] > 0
