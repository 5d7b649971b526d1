"""docker-compose.yml as local processes: the same commands and environments, remapped.

`load_stack` parses the compose file and gives each service's command,
environment and health check with every ``service:port`` (and the service's
own ports) rewritten to 127.0.0.1 and a free port, and pool files in a temp
dir. Nothing else changes, so a passing test proves the file works as written.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.redis.server import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


@dataclass
class Service:
    """One compose service, ready to run locally."""

    name: str
    command: list[str]
    env: dict[str, str]
    health: list[str] | None
    ports: dict[str, int] = field(default_factory=dict)
    """Container port -> local port."""


def load_stack(tmp_path: Path, compose: Path = COMPOSE) -> dict[str, Service]:
    """Every service of the compose file, remapped to run on this host."""
    doc = yaml.safe_load(compose.read_text())
    services = doc["services"]
    ports = {
        (name, str(p)): free_port()
        for name, spec in services.items()
        for p in spec.get("expose", ())
    }

    def remap(value: str, own: str) -> str:
        for (name, port), local in ports.items():
            value = value.replace(f"{name}:{port}", f"127.0.0.1:{local}")
            if name == own:
                value = re.sub(rf"(127\.0\.0\.1|localhost):{port}\b", f"127.0.0.1:{local}", value)
                if value == port:
                    value = str(local)
        return value

    stack = {}
    for name, spec in services.items():
        env = {k: remap(str(v), name) for k, v in (spec.get("environment") or {}).items()}
        if "KVSTORE_SHM_DIR" in env:
            env["KVSTORE_SHM_DIR"] = str(tmp_path)
        health = (spec.get("healthcheck") or {}).get("test")
        stack[name] = Service(
            name,
            [remap(str(a), name) for a in spec["command"]],
            env,
            [remap(str(a), name) for a in health[1:]] if health else None,
            {p: local for (n, p), local in ports.items() if n == name},
        )
    return stack


def spawn(service: Service, log_dir: Path, **env_overrides: str) -> subprocess.Popen[bytes]:
    """Start one service's command with its environment (python = this interpreter)."""
    argv = list(service.command)
    if argv[0] == "python":
        argv[0] = sys.executable
    env = {**os.environ, **service.env, **env_overrides, "PYTHONPATH": str(ROOT)}
    path = log_dir / f"{service.name}-{env.get('KVSTORE_NODE_ID', '')}.log"
    with path.open("wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def healthy(service: Service) -> bool:
    """Run the service's own health check once."""
    assert service.health is not None
    argv = list(service.health)
    if argv[0] == "python":
        argv[0] = sys.executable
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=10, check=False)
    return done.returncode == 0


def wait_healthy(service: Service, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not healthy(service):
        if proc.poll() is not None:
            raise AssertionError(f"{service.name} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{service.name} not healthy after {timeout}s")
        time.sleep(0.1)


def stop(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
