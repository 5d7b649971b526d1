"""A private ``redis-server`` for tests: a free port, no persistence, started and stopped here.

Never the Redis that may run on 6379: every test gets its own process (or
three, for a cluster), and `RedisServer.kill` / `start` on the same port
simulate an outage and a restart (empty, as a restarted cache Redis is).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

REDIS_SERVER = shutil.which("redis-server")
"""Path of redis-server (CI must have it; tests skip with a reason otherwise)."""


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Poll ``check()`` until truthy (returned) or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class RedisServer:
    """One redis-server process on a fixed port."""

    def __init__(self, workdir: Path, port: int | None = None, *extra: str) -> None:
        self.port = port or free_port()
        self.workdir = workdir
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        assert REDIS_SERVER is not None
        return [
            REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.workdir), *self.extra,
        ]  # fmt: skip

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_until(self.ping, timeout, what=f"redis-server on port {self.port}")
        return self

    def ping(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"redis-server on port {self.port} exited {self.proc.returncode}")
        try:
            with redis.Redis(port=self.port, socket_timeout=0.5) as r:
                return bool(r.ping())
        except redis.exceptions.RedisError:
            return False

    def kill(self) -> None:
        """SIGKILL (an outage); `start` brings an empty one back on the same port."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)
