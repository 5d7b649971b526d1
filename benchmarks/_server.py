"""Run a real kvstore server as a child process (benchmarks and the e2e tests use it).

    with ServerProcess.start(shm_dir, capacity="64MiB") as server:
        ... Client(server.target) ...
    # SIGTERM on exit; `stop()` returns the exit status

The server picks a free port (``--port 0``); the port is read from the line
``kvstore-server listening on HOST:PORT`` it prints once serving, then the
standard gRPC health check is polled until it reports SERVING. Every wait is
bounded. The server's stderr (its log) goes to a file next to the pools, so a
failure can show its tail.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

LISTENING_RE = re.compile(r"^kvstore-server listening on (?P<address>\S+)$")
"""The line the server prints once it serves."""

SALT_SECRET = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
"""Fixed salt secret: chain roots are reproducible across runs (and no warning)."""


class ServerStartError(RuntimeError):
    """The server process exited or did not become ready in time."""


@dataclass
class ServerProcess:
    """A running ``python -m service`` child process."""

    process: subprocess.Popen[str]
    """The server process."""
    address: str
    """``host:port`` it listens on."""
    shm_dir: Path
    """Directory of its pool files."""
    pool_prefix: str
    """File name prefix of its pool files."""
    log_path: Path
    """Where its stderr (the log) goes."""
    stdout_lines: queue.Queue[str] = field(default_factory=queue.Queue)
    """Lines it printed on stdout after the listening line."""
    exit_code: int | None = None
    """Exit status once stopped."""
    pump: threading.Thread | None = None
    """The thread that reads its stdout."""

    @property
    def target(self) -> str:
        """What `Client` connects to."""
        return self.address

    @classmethod
    def start(
        cls,
        shm_dir: str | Path,
        *,
        capacity: str = "64MiB",
        extra_args: tuple[str, ...] = (),
        ready_timeout: float = 30.0,
        prefix_stem: str = "kvproc",
    ) -> ServerProcess:
        """Start a server and return once it reports SERVING.

        Args:
            shm_dir: directory for the pool files (a temp dir in tests).
            capacity: the node's memory budget (``--capacity-bytes``).
            extra_args: more flags for ``python -m service``.
            ready_timeout: seconds to wait for the listening line and health.
            prefix_stem: start of the pool file prefix (a random suffix is added).

        Raises:
            ServerStartError: the process died or did not become ready in time.
        """
        shm = Path(shm_dir)
        shm.mkdir(parents=True, exist_ok=True)
        prefix = f"{prefix_stem}{uuid.uuid4().hex[:8]}"
        log_path = shm / f"{prefix}.log"
        argv = [
            sys.executable,
            "-m",
            "service",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--capacity-bytes",
            capacity,
            "--shm-dir",
            str(shm),
            "--pool-prefix",
            prefix,
            "--salt-secret",
            SALT_SECRET,
            "--grace-seconds",
            "2",
            "--log-level",
            "WARNING",
            *extra_args,
        ]
        with open(log_path, "w") as log_file:
            process = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=log_file,
                stdin=subprocess.DEVNULL,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        lines: queue.Queue[str] = queue.Queue()
        pump = threading.Thread(
            target=_pump, args=(process, lines), name="kvstore-server-stdout", daemon=True
        )
        pump.start()
        deadline = time.monotonic() + ready_timeout
        try:
            address = _wait_listening(process, lines, deadline, log_path)
            server = cls(process, address, shm, prefix, log_path, lines, pump=pump)
            server.wait_serving(deadline)
        except BaseException:
            process.kill()
            process.wait(10)
            pump.join(5)
            if process.stdout is not None:
                process.stdout.close()
            raise
        return server

    def wait_serving(self, deadline: float) -> None:
        """Poll the gRPC health service until it answers SERVING (or ``deadline``)."""
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise ServerStartError(
                        f"server at {self.address} not SERVING (exit {self.process.poll()}):\n"
                        + self.log_tail()
                    )
                time.sleep(0.05)

    def pool_files(self) -> list[Path]:
        """Pool files of this server still in the shm dir."""
        return sorted(self.shm_dir.glob(self.pool_prefix + "-*"))

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then wait (bounded) for the exit; SIGKILL if it hangs. Returns the status."""
        if self.exit_code is not None:
            return self.exit_code
        status: int | None = None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
                status = -signal.SIGKILL  # hung on SIGTERM: report it as killed
        if self.pump is not None:
            self.pump.join(5)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.exit_code = self.process.returncode if status is None else status
        return self.exit_code

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _pump(process: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    """Forward the child's stdout lines into a queue (a pipe left unread would fill up)."""
    assert process.stdout is not None
    for line in process.stdout:
        lines.put(line.rstrip("\n"))


def _wait_listening(
    process: subprocess.Popen[str], lines: queue.Queue[str], deadline: float, log_path: Path
) -> str:
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ServerStartError(
                "no 'listening on' line in time:\n" + log_path.read_text(errors="replace")
            )
        try:
            line = lines.get(timeout=min(remaining, 0.2))
        except queue.Empty:
            if process.poll() is not None:
                raise ServerStartError(
                    f"server exited with {process.returncode} before listening:\n"
                    + log_path.read_text(errors="replace")
                ) from None
            continue
        match = LISTENING_RE.match(line)
        if match:
            return match.group("address")
