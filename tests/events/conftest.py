"""Fixtures of the KV-event tests: the optional extra, and lines from a subprocess."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from tests.service.conftest import server_config  # noqa: F401  (a fixture, reused)

pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
pytest.importorskip("msgpack", reason="the events extra (msgpack) is not installed")


async def read_line(proc: subprocess.Popen[str], deadline: float) -> str:
    """The next stdout line of ``proc`` (read on a thread); fails past ``deadline``."""
    assert proc.stdout is not None
    left = deadline - time.monotonic()
    if left <= 0:
        raise AssertionError("timed out waiting for the subprocess")
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), left)
    if not line:
        raise AssertionError(f"the subprocess ended (rc {proc.poll()}) before answering")
    return line.strip()


def stop(proc: subprocess.Popen[str]) -> None:
    """Close stdin (the scripts exit on EOF), then kill if it lingers."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=10)
    except (subprocess.TimeoutExpired, OSError):
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.stdout is not None:
            proc.stdout.close()


async def until(condition, within: float = 10.0, what: str = "condition") -> None:
    """Wait (on the loop) until ``condition()`` is true; fail after ``within`` s."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
