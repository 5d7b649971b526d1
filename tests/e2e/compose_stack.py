"""docker-compose.yml as local processes that see what their containers would see.

`load_stack` parses the compose file and gives each service its command,
environment, health check, volumes and published ports. Every
``service:port`` (and a service's own ports) becomes 127.0.0.1 and a free
port; every path a volume is mounted at becomes the same path under one
local "container root". Nothing else changes.

`spawn` starts a service in **its own mount namespace** (``unshare --mount``,
root only), as Docker would start its container:

* a private tmpfs on ``/dev/shm`` (every container has its own);
* a private tmpfs on the container root, so a path that the service does not
  mount a volume at is an empty directory there, whatever other services put
  at that path;
* each named volume it mounts: a bind mount of that volume's one directory,
  so services that mount the same volume share files, as in compose;
* no torch for services whose image is built without extras
  (``build.args.EXTRAS`` empty): ``import torch`` fails there as in the image.

Network, users and the rest of the filesystem stay the host's: the nodes and
runners still reach each other over loopback, and a volume is a plain
directory (compose's is a tmpfs; files and ``mmap`` behave the same).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from tests.redis.server import free_port
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"

NO_TORCH = (
    "raise ModuleNotFoundError(\"No module named 'torch' (image without extras)\", name='torch')\n"
)


UNSHARE = ["unshare", "--mount", "--propagation", "private", "--"]
"""A new mount namespace whose mounts never reach the host's."""


@dataclass(frozen=True)
class Mount:
    """A named volume mounted into a service."""

    volume: str
    target: str
    """Path in the container, as written in the compose file."""


@dataclass
class Service:
    """One compose service, ready to run locally."""

    name: str
    command: list[str]
    env: dict[str, str]
    health: list[str] | None
    ports: dict[str, int] = field(default_factory=dict)
    """Container port -> local port."""
    published: list[tuple[str, str, str]] = field(default_factory=list)
    """``ports:`` entries as written: (host address, host port, container port)."""
    mounts: list[Mount] = field(default_factory=list)
    extras: str | None = None
    """``build.args.EXTRAS``: "" = an image without torch; None = not built here."""
    stack: Stack | None = field(default=None, repr=False)

    def without_volumes(self) -> Service:
        """The same service with no volume mounted (a runner someone forgot to give them)."""
        return replace(self, mounts=[])


@dataclass
class Stack:
    """The parsed file plus where its volumes and container root live locally."""

    services: dict[str, Service]
    volumes: dict[str, dict[str, Any]]
    """Top-level ``volumes:`` with their driver options."""
    workdir: Path
    """Holds ``rootfs/`` (container paths) and ``volumes/NAME`` (each volume's files)."""

    def __getitem__(self, name: str) -> Service:
        return self.services[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.services)

    def local_path(self, container_path: str) -> Path:
        """Where a container path lives locally (inside a service's namespace)."""
        return self.workdir / "rootfs" / container_path.lstrip("/")

    def volume_dir(self, volume: str) -> Path:
        return self.workdir / "volumes" / volume


_VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def with_defaults(text: str) -> str:
    """Compose's ``${VAR:-default}`` with no variable set: each default (or "")."""
    return _VARIABLE.sub(lambda m: m.group(2) or "", text)


def load_stack(workdir: Path, compose: Path = COMPOSE) -> Stack:
    """Every service of the compose file, remapped to run on this host.

    ``${VAR:-default}`` reads as its default: the file as run with no overrides.
    """
    doc = yaml.safe_load(with_defaults(compose.read_text()))
    services = doc["services"]
    ports = {
        (name, str(p)): free_port()
        for name, spec in services.items()
        for p in spec.get("expose", ())
    }
    mounts = {name: [_mount(m) for m in spec.get("volumes", ())] for name, spec in services.items()}
    targets = sorted({m.target for ms in mounts.values() for m in ms}, key=len, reverse=True)
    stack = Stack({}, dict(doc.get("volumes") or {}), workdir)

    def remap(value: str, own: str) -> str:
        for (name, port), local in ports.items():
            value = value.replace(f"{name}:{port}", f"127.0.0.1:{local}")
            if name == own:
                value = re.sub(rf"(127\.0\.0\.1|localhost):{port}\b", f"127.0.0.1:{local}", value)
                if value == port:
                    value = str(local)
        for target in targets:
            if value == target or value.startswith(target + "/"):
                return str(stack.local_path(target)) + value[len(target) :]
        return value

    for name, spec in services.items():
        env = {k: remap(str(v), name) for k, v in (spec.get("environment") or {}).items()}
        health = (spec.get("healthcheck") or {}).get("test")
        build = spec.get("build")
        extras = None
        if isinstance(build, dict):
            extras = str((build.get("args") or {}).get("EXTRAS", ""))
        elif build is not None:
            extras = ""
        stack.services[name] = Service(
            name,
            [remap(str(a), name) for a in spec["command"]],
            env,
            [remap(str(a), name) for a in health[1:]] if health else None,
            {p: local for (n, p), local in ports.items() if n == name},
            [_published(str(p)) for p in spec.get("ports", ())],
            mounts[name],
            extras,
            stack,
        )
    return stack


def _mount(entry: object) -> Mount:
    if isinstance(entry, dict):
        return Mount(str(entry["source"]), str(entry["target"]))
    source, target = str(entry).split(":")[:2]
    return Mount(source, target)


def _published(entry: str) -> tuple[str, str, str]:
    parts = entry.split(":")
    if len(parts) == 2:
        parts = ["0.0.0.0", *parts]
    host, host_port, container_port = parts
    return host, host_port, container_port


def mount_namespaces_work() -> str | None:
    """None where `spawn` can isolate services; else why not (the reason to skip)."""
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    with tempfile.TemporaryDirectory() as probe:
        done = subprocess.run(
            [*UNSHARE, "sh", "-c", 'mount -t tmpfs kvstore-probe "$1"', "sh", probe],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    if done.returncode != 0:
        return f"mount namespaces are not permitted here (unshare: {done.stderr.strip()})"
    return None


def _namespace_script(stack: Stack, service: Service) -> str:
    """Shell that builds the service's mounts in its new namespace, then execs its command."""
    rootfs = stack.local_path("/")
    lines = [
        "set -e",
        f"mount -t tmpfs -o mode=755 kvstore-rootfs {shlex.quote(str(rootfs))}",
    ]
    for m in service.mounts:
        source, target = stack.volume_dir(m.volume), stack.local_path(m.target)
        lines.append(f"mkdir -p {shlex.quote(str(target))}")
        lines.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(str(target))}")
    # Last: a workdir under /dev/shm would otherwise be hidden before the binds.
    lines.append("mount -t tmpfs -o size=64m,mode=1777 kvstore-shm /dev/shm")
    lines.append('exec "$@"')
    return "\n".join(lines)


def spawn(
    service: Service,
    log_dir: Path | None = None,
    *,
    isolated: bool = False,
    log_name: str | None = None,
    **env_overrides: str,
) -> subprocess.Popen[bytes]:
    """Start one service's command with its environment.

    Args:
        service: from `load_stack`.
        log_dir: where ``{log_name}.log`` goes (default: the stack's workdir).
        isolated: in its own mount namespace with only its own volumes, as in
            its container (needs `mount_namespaces_work`); False: on the host's
            filesystem, every volume path shared by every process.
        log_name: default ``{service}-{KVSTORE_NODE_ID}``.
        env_overrides: on top of the service's environment.
    """
    stack = service.stack
    assert stack is not None, "services come from load_stack"
    argv = list(service.command)
    if argv[0] == "python":
        argv[0] = sys.executable
    path = [str(ROOT)]
    if service.extras == "":
        shim = stack.workdir / "no-torch"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "torch.py").write_text(NO_TORCH)
        path.insert(0, str(shim))
    env = {**os.environ, **service.env, **env_overrides, "PYTHONPATH": os.pathsep.join(path)}
    for m in service.mounts:
        stack.volume_dir(m.volume).mkdir(parents=True, exist_ok=True)
    if isolated:
        stack.local_path("/").mkdir(parents=True, exist_ok=True)
        argv = [*UNSHARE, "sh", "-c", _namespace_script(stack, service), "sh", *argv]
    else:
        for m in service.mounts:  # one filesystem: every service sees every volume
            target = stack.local_path(m.target)
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(stack.volume_dir(m.volume), target_is_directory=True)
    name = log_name or f"{service.name}-{env.get('KVSTORE_NODE_ID', '')}"
    log = (log_dir or stack.workdir) / f"{name}.log"
    with log.open("wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def log_of(stack: Stack, name: str) -> str:
    return (stack.workdir / f"{name}.log").read_text()


def healthy(service: Service) -> bool:
    """Run the service's own health check once (it only needs the network)."""
    assert service.health is not None
    argv = list(service.health)
    if argv[0] == "python":
        argv[0] = sys.executable
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=10, check=False)
    return done.returncode == 0


def wait_healthy(service: Service, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    def ready() -> bool:
        if healthy(service):
            return True
        if proc.poll() is not None:
            raise AssertionError(f"{service.name} exited with {proc.returncode}")
        return False

    wait_until(ready, within=timeout, interval=0.1, what=f"{service.name} to be healthy")


def stop(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
