"""`benchmarks.bench_lmcache` skips cleanly (JSON, rc 0) where LMCache cannot be measured."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from benchmarks import bench_lmcache


def _skipped(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    bench_lmcache.main(argv)  # returns: no SystemExit, no server started
    report = json.loads(capsys.readouterr().out)
    assert report["benchmark"] == "bench_lmcache"
    return str(report["skipped"])


def test_skips_without_an_lmcache_python(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(bench_lmcache.ENV_PYTHON, raising=False)
    assert "no LMCache python" in _skipped(capsys, ["--quick"])


def test_skips_when_the_python_is_not_an_executable(
    capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    missing = f"{tmp_path}/no-such-python"
    assert "not an executable" in _skipped(capsys, ["--quick", "--lmcache-python", missing])


@pytest.mark.skipif(
    importlib.util.find_spec("lmcache") is not None, reason="this python has lmcache"
)
def test_skips_when_the_python_cannot_import_lmcache(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(bench_lmcache.ENV_PYTHON, sys.executable)
    assert "cannot import lmcache" in _skipped(capsys, ["--quick"])
