"""A real cache node as a subprocess, shared by the integration tests of a module."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

_LISTENING = re.compile(r"kvstore-server listening on (\S+)")


@pytest.fixture(scope="module")
def kv_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``host:port`` of a `python -m service` process (stopped with SIGTERM afterwards)."""
    shm = tmp_path_factory.mktemp("shm")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--capacity-bytes",
            "256MiB",
            "--namespace-capacity-bytes",
            "8MiB",
            "--shm-dir",
            str(shm),
            "--pool-prefault",
            "false",
            "--log-level",
            "WARNING",
        ],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    target = _wait_listening(proc)
    # Keep draining the pipe so the server never blocks on a full stdout.
    drain = threading.Thread(target=proc.stdout.read, daemon=True)
    drain.start()
    try:
        yield target
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        drain.join(5)
        proc.stdout.close()


def _wait_listening(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    lines = []
    timer = threading.Timer(30.0, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            match = _LISTENING.search(line)
            if match:
                return match.group(1)
    finally:
        timer.cancel()
    raise RuntimeError("the kvstore server did not start:\n" + "".join(lines))
