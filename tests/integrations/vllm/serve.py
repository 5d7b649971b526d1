"""`vllm serve` processes as users start them (the tests and `bench_multiturn`).

The OpenAI-compatible server runs through ``python -m kvstore.integrations.vllm.cli``
(the ``kvstore-vllm`` script: vLLM's own CLI, which on vLLM's CPU build fails at
once when started as ``vllm``), in its own process group, logging to a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.integrations.vllm.engines import ENGINE_NICE, niced, vllm_environment
from tests.waiting import wait_until

CLI = ("-m", "kvstore.integrations.vllm.cli")
MODEL_NAME = "tiny"
START_TIMEOUT = 400.0  # the box is shared with other engines' tests
STOP_TIMEOUT = 60.0
SHUTDOWN_TIMEOUT = 10  # `--shutdown-timeout`: EngineCore gets this long after SIGTERM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_transfer(extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for the kvstore connector with these settings."""
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def samples(metrics: str, name: str, label: str = "") -> list[float]:
    """The values of metric ``name`` on a ``/metrics`` page, one per label set whose
    labels contain ``label`` (e.g. ``source="local_compute"``)."""
    values = []
    for line in metrics.splitlines():
        head, _, value = line.rpartition(" ")
        if head.partition("{")[0] == name and label in head:
            values.append(float(value))
    return values


class ServeProcess:
    """One `vllm serve` process (its own process group), logging to a file."""

    def __init__(
        self,
        python: str,
        model: Path,
        *,
        log_dir: Path,
        name: str,
        connector: dict[str, Any] | None,
        block_size: int = 32,
        max_model_len: int = 2048,
        max_num_batched_tokens: int | None = None,
        nice: int = ENGINE_NICE,
    ) -> None:
        """Start it (`wait_ready` waits); ``connector``: the kvstore settings, None: none;
        ``nice``: its niceness (`ENGINE_NICE`; the benchmarks pass 0)."""
        self.name = name
        self.port = free_port()
        self.log_path = log_dir / f"{name}.log"
        args = [
            *("serve", str(model), "--served-model-name", MODEL_NAME),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--block-size", str(block_size), "--dtype", "float32", "--enforce-eager"),
            *("--max-model-len", str(max_model_len)),
            *("--shutdown-timeout", str(SHUTDOWN_TIMEOUT)),
        ]
        if max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        if connector is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer(connector))]
        cache = tempfile.mkdtemp(prefix="vllm-cache-", dir=log_dir)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                niced([python, *CLI, *args], nice),
                cwd=log_dir,
                env=vllm_environment(cache),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, lines: int = 60) -> str:
        return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"server {self.name} exited ({self.proc.returncode}):\n{self.tail()}"
            )
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self) -> ServeProcess:
        wait_until(
            self.healthy,
            what=f"server {self.name} healthy",
            within=START_TIMEOUT,
            interval=0.5,
            tail=self.tail,
        )
        return self

    def complete(self, prompt: list[int]) -> str:
        body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as answer:
            choice = json.load(answer)["choices"][0]
        assert choice["finish_reason"] == "length", choice
        return str(choice["text"])

    def metrics(self) -> str:
        """The server's ``/metrics`` page (Prometheus text)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as answer:
            return str(answer.read().decode())

    def counter(self, name: str, *, required: bool = True) -> float:
        """The sum of a counter over its label sets on ``/metrics`` (0 if absent and not
        ``required``)."""
        values = samples(self.metrics(), name)
        assert values or not required, f"{name} not on /metrics"
        return sum(values)

    def stop(self) -> int | None:
        """SIGTERM to the API server (as an operator stops it), bounded; then SIGKILL the group.

        Returns the API server's exit code, None if it had to be killed.
        """
        code: int | None = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.proc.wait(STOP_TIMEOUT)
        else:
            code = self.proc.returncode
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # EngineCore and anything left behind
        self.proc.wait()
        return code
