"""Real vLLM engine processes and real cache nodes for the vLLM tests and benchmark.

vLLM lives in its own virtual environment (see `.ci/run`): its python is
``$KVSTORE_VLLM_PYTHON``, else this interpreter when it can import vllm.
Each `Engine` is one `driver.py` process (one ``LLM``); each `Node` one
``python -m service`` process of the main environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks._server import ServerProcess

ROOT = Path(__file__).resolve().parents[3]
DRIVER = Path(__file__).with_name("driver.py")


def vllm_python() -> str | None:
    """The python of an environment with vLLM, or None."""
    configured = os.environ.get("KVSTORE_VLLM_PYTHON")
    if configured:
        return configured
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm"], capture_output=True, timeout=120, check=False
    )
    return sys.executable if probe.returncode == 0 else None


def vllm_environment(cache: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM process: offline, its own cache folder, this tree's kvstore."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CACHE_ROOT": cache,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONPATH": str(ROOT),
        **(extra or {}),
    }
    # vLLM's own block hashes are random per process without this; the connector
    # must not depend on it (docs/vllm.md), so the tests run with it unset.
    env.pop("PYTHONHASHSEED", None)
    return env


@contextlib.contextmanager
def running(engines: dict[str, Engine]) -> Iterator[dict[str, Engine]]:
    """Wait until every engine (started together) is ready; close them all at the end."""
    try:
        for engine in engines.values():
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines.values():
            engine.close()


SHM_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else None
"""Where the tests' nodes keep their pool files (None: the system's temporary folder)."""


class Node:
    """A cache node (`benchmarks._server.ServerProcess`) that comes back on the same port."""

    def __init__(
        self, workdir: Path, *, namespace_capacity: str = "8MiB", extra_args: tuple[str, ...] = ()
    ) -> None:
        self.workdir = workdir
        self.namespace_capacity = namespace_capacity
        self.extra_args = extra_args
        self.port = 0
        self.server: ServerProcess | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Node:
        """Start on the port of the last start (a free one the first time), empty memory.

        The pool files go to a tmpfs (``/dev/shm``) as in production: on the test's own
        folder (a disk here) the kernel writes the KV bytes back to the disk, and a busy
        2-core host spends its time there. `stop` keeps the node's log in ``workdir``.
        """
        shm = Path(tempfile.mkdtemp(prefix="kvstore-test-", dir=SHM_ROOT))
        flags = ("--port", str(self.port), "--namespace-capacity-bytes", self.namespace_capacity)
        self.server = ServerProcess.start(
            shm,
            capacity="256MiB",
            extra_args=(*flags, "--pool-prefault", "false", *self.extra_args),
            ready_timeout=60.0,
        )
        self.port = int(self.server.address.rsplit(":", 1)[1])
        return self

    def kill(self) -> None:
        """SIGKILL: the node dies without draining (as in a crash)."""
        if self.server is not None:
            self.server.process.kill()
            self.stop()

    def pause(self) -> None:
        """SIGSTOP: the node hangs (connections stay open, nothing answers)."""
        assert self.server is not None
        self.server.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        assert self.server is not None
        self.server.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            shm = self.server.shm_dir
            shutil.copy(self.server.log_path, self.workdir / self.server.log_path.name)
            shutil.rmtree(shm, ignore_errors=True)
            self.server = None

    def stats(self) -> Any:
        """The node's Stats. Its deadline is generous: on the 2-core CI box a TP=2 engine's
        processes poll busily while one rank is held, and the node then answers slowly."""
        from kvstore.client import SyncClient

        with SyncClient(self.target, timeout=30.0) as client:
            return client.stats(timeout=30.0)


ENGINE_NICE = 10
"""The tests' engines run at this niceness (their processes inherit it), below the node
and the test. An engine whose request waits for a load steps empty batches in a busy
loop, engine core and workers alike; on the 2-core CI host that starved the node and
the test (with a TP=2 load held it stalled the whole host for minutes even so: the
tests that hold loads wait that out, docs/vllm.md "Tests and CI"). In production the
node has its own cores."""


def niced(argv: list[str], nice: int) -> list[str]:
    """``argv`` run at niceness ``nice`` (unchanged at 0)."""
    return ["nice", "-n", str(nice), *argv] if nice else argv


class Engine:
    """One vLLM engine (`driver.py`) in its own process; commands over stdin.

    ``nice`` defaults to `ENGINE_NICE`; the benchmarks pass 0 to measure engines as run.
    """

    def __init__(
        self,
        python: str,
        model: Path,
        *,
        connector: dict[str, Any] | None,
        block_size: int = 32,
        log_dir: Path,
        name: str,
        env: dict[str, str] | None = None,
        nice: int = ENGINE_NICE,
        **spec: Any,
    ) -> None:
        spec = {"model": str(model), "block_size": block_size, "connector": connector, **spec}
        full_env = vllm_environment(tempfile.mkdtemp(prefix="vllm-cache-", dir=log_dir), env)
        self.name = name
        self.log = deque(maxlen=400)
        self.log_path = log_dir / f"{name}.log"
        self.proc = subprocess.Popen(
            niced([python, str(DRIVER), json.dumps(spec)], nice),
            cwd=log_dir,
            env=full_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._results: list[str] = []
        self._sent = 0
        self._cond = threading.Condition()
        self._ready = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                self.log.append(line)
                with self._cond:
                    if line.startswith("@@READY"):
                        self._ready = True
                    elif "@@RESULT " in line:  # a log line may share it (see `answer`)
                        self._results.append(line[line.index("@@RESULT ") + len("@@RESULT ") :])
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_ready(self, timeout: float = 400.0) -> Engine:
        self._wait(lambda: self._ready, timeout, "start")
        return self

    def _wait(self, done: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not done():
                if self.proc.poll() is not None and not done():
                    raise RuntimeError(f"engine {self.name} exited during {what}:\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"engine {self.name} did not {what}:\n{self.tail()}")
                self._cond.wait(min(left, 1.0))

    def tail(self) -> str:
        return "".join(list(self.log)[-60:])

    def command(self, timeout: float = 300.0, **command: Any) -> dict[str, Any]:
        return self.answer(self.send(**command), timeout)

    def send(self, **command: Any) -> int:
        """Send a command without waiting; returns the ticket `answer` takes."""
        assert self.proc.stdin is not None
        ticket, self._sent = self._sent, self._sent + 1  # answers come in order
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return ticket

    def answer(self, ticket: int, timeout: float = 300.0) -> dict[str, Any]:
        """The answer of a `send`, waiting up to ``timeout`` seconds."""
        self._wait(lambda: len(self._results) > ticket, timeout, f"answer command {ticket}")
        # vLLM's engine-core process logs to the same pipe: a log line can land on the end
        # of the answer's line before its newline. The answer is the JSON object up front.
        answer, _ = json.JSONDecoder().raw_decode(self._results[ticket])
        return dict(answer)

    def pause(self) -> None:
        """SIGSTOP every process of the engine (a stalled host, swapped out, debugged)."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        os.killpg(self.proc.pid, signal.SIGCONT)

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> dict[str, Any]:
        return self.command(prompts=prompts, max_tokens=max_tokens)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"exit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        self._reader.join(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


@contextlib.contextmanager
def verifying_node(workdir: Path) -> Iterator[Node]:
    """A node like conftest's (a 2 MiB namespace) whose runners check every local load's
    bytes against their writer's checksum (``verify_checksums = "all"``)."""
    node = Node(workdir, namespace_capacity="2MiB", extra_args=("--verify-checksums", "all"))
    try:
        yield node.start()
    finally:
        node.stop()


def published(redis_url: str, node_id: str) -> int:
    """Blocks the Redis directory lists under ``node_id`` (every namespace and tenant)."""
    import redis

    with redis.Redis.from_url(redis_url, socket_timeout=5) as r:
        return sum(int(r.scard(key)) for key in r.scan_iter(match=f"*:n:{node_id}"))


def cleanup_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
