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
from pathlib import Path

import redis

from tests.waiting import wait_until

REDIS_SERVER = shutil.which("redis-server")
"""Path of redis-server (CI must have it; tests skip with a reason otherwise)."""


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        wait_until(
            self.ping, within=timeout, interval=0.02, what=f"redis-server on port {self.port}"
        )
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


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free as well."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            port = 20000 + port % 20000  # the kernel's ephemeral range is too high
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise AssertionError("no free port pair for a Redis Cluster node")


class RedisClusterServers:
    """Three masters (no replicas) in one Redis Cluster, on free ports, in ``workdir``.

    ``cluster-require-full-coverage no``: with a master down, the slots of
    the other two keep answering (docs/cluster.md recommends it).
    """

    NODE_TIMEOUT_MS = 1000

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.servers = [
            RedisServer(
                workdir / f"m{i}",
                free_cluster_port(),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(self.NODE_TIMEOUT_MS),
                "--cluster-require-full-coverage",
                "no",
            )
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        """The URL a node is given (any master: the client discovers the rest)."""
        return self.servers[0].url

    def start(self, timeout: float = 20.0) -> RedisClusterServers:
        for server in self.servers:
            server.start()
        cli = shutil.which("redis-cli")
        assert cli is not None, "redis-cli is needed next to redis-server"
        addresses = [f"127.0.0.1:{s.port}" for s in self.servers]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        for server in self.servers:
            wait_until(
                lambda s=server: self.state_ok(s),
                within=timeout,
                interval=0.02,
                what="cluster_state:ok",
            )
        return self

    def state_ok(self, server: RedisServer) -> bool:
        """Whether ``server`` says cluster_state:ok (it knows every slot's master)."""
        try:
            with server.client() as r:
                info = r.execute_command("CLUSTER", "INFO")
        except redis.exceptions.RedisError:
            return False
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text

    def master_of(self, key: str) -> RedisServer:
        """The master serving ``key``'s hash slot."""
        with self.servers[0].client() as r:
            slot = int(r.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(master[1])
                    return next(s for s in self.servers if s.port == port)
        raise AssertionError(f"no master serves the slot of {key!r}")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
