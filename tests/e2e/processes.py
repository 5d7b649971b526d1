"""Real server and runner processes of the e2e and fault tests.

- `shm_parent`: where a node process keeps its pools (tmpfs when there is one); the
  ``kv_node`` fixture (tests/conftest.py) starts ``python -m service`` there.
- `run_runner` runs ``python -m tests.e2e.runner`` to completion and returns
  its JSON; `LiveRunner` is one that keeps running (pins held, to be killed).
- `node_stats` / `wait_for_stats`: the node's Stats, and a bounded poll on it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
"""Repository root: runners start there so ``-m tests.e2e.runner`` resolves."""

RUNNER = [sys.executable, "-m", "tests.e2e.runner"]

RUNNER_TIMEOUT = 60.0
"""Longest a runner may take before the test fails (none should come close)."""


def shm_parent() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def runner_argv(target: str, command: str, *args: str, **options: Any) -> list[str]:
    """``python -m tests.e2e.runner --target ... [--option value] command args``."""
    argv = [*RUNNER, "--target", target]
    for name, value in options.items():
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return [*argv, command, *args]


def run_runner(
    target: str, command: str, *args: str, timeout: float = RUNNER_TIMEOUT, **options: Any
) -> dict[str, Any]:
    """Run one runner process to completion; its last stdout line, parsed."""
    proc = subprocess.run(
        runner_argv(target, command, *args, **options),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"runner {command} failed ({proc.returncode}):\n{proc.stderr}"
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc


def run_ops(target: str, program: list[dict[str, Any]], **options: Any) -> list[dict[str, Any]]:
    """Run a runner process over a list of store / lookup operations; their results."""
    results: list[dict[str, Any]] = run_runner(
        target, "ops", "--program", json.dumps(program), **options
    )["results"]
    return results


class LiveRunner:
    """A runner process that keeps running; its JSON lines arrive on a queue."""

    def __init__(self, target: str, command: str, *args: str, **options: Any) -> None:
        self.process = subprocess.Popen(
            runner_argv(target, command, *args, **options),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self._stderr: list[str] = []
        self._threads = [
            threading.Thread(target=self._pump_stdout, daemon=True),
            threading.Thread(target=self._pump_stderr, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _pump_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)

    def _pump_stderr(self) -> None:
        assert self.process.stderr is not None
        self._stderr.extend(self.process.stderr)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def wait_event(self, event: str, timeout: float = RUNNER_TIMEOUT) -> dict[str, Any]:
        """The next JSON line whose ``event`` is ``event`` (bounded wait)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {event!r} line in {timeout} s:\n{self.stderr}")
            try:
                line = self._lines.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                if self.process.poll() is not None and self._lines.empty():
                    raise AssertionError(
                        f"runner exited with {self.process.returncode} before {event!r}:\n"
                        + self.stderr
                    ) from None
                continue
            doc: dict[str, Any] = json.loads(line)
            if doc.get("event") == event:
                return doc

    def json_lines(self) -> list[dict[str, Any]]:
        """Every JSON line received and not yet consumed by `wait_event` (drains them)."""
        docs: list[dict[str, Any]] = []
        while True:
            try:
                docs.append(json.loads(self._lines.get_nowait()))
            except queue.Empty:
                return docs

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def kill(self) -> int:
        """SIGKILL: no cleanup runs in the runner (no Release, no CloseLease)."""
        self.process.send_signal(signal.SIGKILL)
        return self.wait()

    def wait(self, timeout: float = RUNNER_TIMEOUT) -> int:
        status = self.process.wait(timeout)
        for thread in self._threads:
            thread.join(5)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
        return status

    def stop(self) -> None:
        """Kill it if still running (test teardown)."""
        if self.process.poll() is None:
            self.process.kill()
        self.wait()


def node_stats(target: str, tenant: str | None = None) -> pb.StatsResponse:
    """The node's Stats, over a fresh channel."""
    metadata = (("x-kvstore-tenant", tenant),) if tenant else ()
    with grpc.insecure_channel(target) as channel:
        stats: pb.StatsResponse = kvstore_pb2_grpc.KVStoreStub(channel).Stats(
            pb.StatsRequest(), timeout=5.0, metadata=metadata
        )
    return stats


def wait_for_stats(
    target: str,
    condition: Callable[[pb.StatsResponse], bool],
    *,
    timeout: float,
    what: str,
    interval: float = 0.05,
) -> pb.StatsResponse:
    """Poll Stats until ``condition`` holds; fail with the last Stats after ``timeout``."""
    stats: pb.StatsResponse = wait_until(
        lambda: node_stats(target), ok=condition, within=timeout, interval=interval, what=what
    )
    return stats


def namespace_stats(stats: pb.StatsResponse, namespace_id: str) -> pb.NamespaceStats:
    """One namespace's entry of a Stats answer."""
    for ns in stats.namespaces:
        if ns.namespace_id == namespace_id:
            return ns
    raise AssertionError(f"namespace {namespace_id} not in Stats: {stats}")
