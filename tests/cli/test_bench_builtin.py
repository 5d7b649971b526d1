"""``kvstore bench`` alone works outside a checkout, without torch, cupy or a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCKED = ("torch", "cupy", "benchmarks")
"""Modules the built-in benchmarks must not import (an import of one raises)."""

RUN = (
    "import sys\n"
    f"for name in {BLOCKED!r}: sys.modules[name] = None\n"
    "sys.argv = ['kvstore', *sys.argv[1:]]\n"
    "from kvstore.cli import main\n"
    "main()\n"
)


def bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``kvstore bench ARGS`` from an empty directory, with `BLOCKED` unimportable."""
    return subprocess.run(
        [sys.executable, "-c", RUN, "bench", *args],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "COLUMNS": "80", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_bench_runs_outside_a_checkout_without_torch(tmp_path):
    proc = bench(tmp_path, "--quick", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["source"] == "built-in" and doc["failed"] == [] and doc["quick"]
    assert list(doc["benchmarks"]) == ["hashing", "lookup", "metadata"]
    numbers = {k: r["numbers"] for k, r in doc["benchmarks"].items()}
    assert numbers["hashing"]["tokens"] == 8192
    assert numbers["hashing"]["kvstore_sha256_tokens_per_s"] > 0
    assert numbers["lookup"]["lookup_512_us"] > 0
    assert numbers["metadata"]["metadata_bytes_per_block"] > 0


def test_bench_table_fits_80_columns(tmp_path):
    proc = bench(tmp_path, "--quick")
    assert proc.returncode == 0, proc.stderr
    lines = [line.rstrip() for line in proc.stdout.splitlines() if line.strip()]
    assert any(line.startswith("lookup") and "lookup_512_us" in line for line in lines)
    assert all(len(line) <= 80 for line in lines), proc.stdout
    assert "…" not in proc.stdout


def test_repository_benchmarks_still_need_a_checkout(tmp_path):
    proc = bench(tmp_path, "core")
    assert proc.returncode == 5
    assert "no benchmarks/ in" in proc.stderr and "kvstore bench` alone" in proc.stderr
