"""docker-compose.yml works as written: Redis, two nodes and both runners, as local processes."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.e2e.compose_stack import load_stack, spawn, stop, wait_healthy

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


def test_compose_file_declares_the_stack(tmp_path):
    stack = load_stack(tmp_path)
    assert set(stack) == {"redis", "node-1", "node-2", "runner", "chat-runner"}
    for name in ("redis", "node-1", "node-2"):
        assert stack[name].health, f"{name} needs a health check"
    assert stack["node-1"].env["KVSTORE_REDIS_URL"].startswith("redis://127.0.0.1:")
    assert stack["node-1"].env["KVSTORE_SALT_SECRET"] == stack["node-2"].env["KVSTORE_SALT_SECRET"]


def test_compose_stack_runs_as_written(tmp_path):
    stack = load_stack(tmp_path)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in ("redis", "node-1", "node-2"):
            proc = spawn(stack[name], tmp_path)
            procs.append(proc)
            wait_healthy(stack[name], proc)
        runner = spawn(stack["runner"], tmp_path)
        procs.append(runner)
        chat = spawn(stack["chat-runner"], tmp_path)
        procs.append(chat)
        code = runner.wait(90)
        log = (tmp_path / "runner-.log").read_text()
        assert code == 0, log
        assert "synthetic_runner: ok" in log
        code = chat.wait(120)
        log = (tmp_path / "chat-runner-.log").read_text()
        assert code == 0, log
        summary = json.loads(log[log.index("{") : log.rindex("}") + 1])
        assert summary["logits_match"] is True
        assert summary["prefill_tokens_saved"] > 0
    finally:
        for proc in reversed(procs):
            stop(proc)
