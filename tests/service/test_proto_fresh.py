"""The committed generated modules match what scripts/gen_proto.sh produces now."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "kvstore" / "v1"


def test_generated_modules_are_fresh(tmp_path):
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    fresh = tmp_path / "kvstore" / "v1"
    names = sorted(p.name for p in fresh.iterdir() if p.is_file())
    assert names == sorted(
        p.name for p in GENERATED.iterdir() if p.is_file() and p.suffix in (".py", ".pyi")
    )
    for name in names:
        assert (fresh / name).read_text() == (GENERATED / name).read_text(), (
            f"kvstore/v1/{name} is stale: run scripts/gen_proto.sh"
        )
