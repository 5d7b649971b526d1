"""The benchmarks that need no vLLM still run: each prints its JSON on a --quick run
(`bench_disk_restart` starts its own node processes, the others need no server).

They import the SDK's and the node's internals (a lazy `Hit`, the wire
converters), so a refactor that breaks them shows here, not in a user's
terminal. Figures are not checked: benchmarks are measured, never asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("module", "key"),
    [
        ("benchmarks.bench_copy", "gbps"),
        ("benchmarks.bench_wire", "hashes"),
        ("benchmarks.bench_checksum", "sizes"),
        ("benchmarks.bench_verify", "lengths"),
        ("benchmarks.bench_disk", "sizes"),
        ("benchmarks.bench_disk_restart", "runs"),
    ],
)
def test_a_quick_run_prints_its_figures(module: str, key: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", module, "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert key in json.loads(proc.stdout)
