"""docker-compose.yml works as written, each service seeing only what its container would.

Every service runs in its own mount namespace (tests/e2e/compose_stack.py):
its own /dev/shm, and of the pool volumes only those the file mounts into it.
So a runner that the file does not give a node's pool volume cannot map that
node's pool here either, as in Docker; and the runners that the file does
give it read and write the nodes' pools in place.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest

from tests.e2e.compose_stack import (
    COMPOSE,
    Service,
    Stack,
    load_stack,
    log_of,
    mount_namespaces_work,
    spawn,
    stop,
    wait_healthy,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

NODES = ("node-1", "node-2")
RUNNERS = ("runner", "chat-runner")


def targets_of(stack: Stack, runner: str) -> set[str]:
    """The node services a runner talks to (KVSTORE_TARGET(S), before remapping)."""
    env = stack[runner].env
    names = set()
    for node in NODES:
        port = stack[node].ports["50051"]
        if any(
            f"127.0.0.1:{port}" in env.get(k, "") for k in ("KVSTORE_TARGET", "KVSTORE_TARGETS")
        ):
            names.add(node)
    return names


def test_compose_file_declares_the_stack(tmp_path):
    stack = load_stack(tmp_path)
    assert set(stack) == {"redis", *NODES, *RUNNERS}
    for name in ("redis", *NODES):
        assert stack[name].health, f"{name} needs a health check"
    assert stack["node-1"].env["KVSTORE_REDIS_URL"].startswith("redis://127.0.0.1:")
    assert stack["node-1"].env["KVSTORE_SALT_SECRET"] == stack["node-2"].env["KVSTORE_SALT_SECRET"]


def test_each_node_keeps_its_pool_in_a_tmpfs_volume_its_runners_mount(tmp_path):
    stack = load_stack(tmp_path)
    for node in NODES:
        shm_dir = stack[node].env["KVSTORE_SHM_DIR"]
        (mount,) = [m for m in stack[node].mounts if str(stack.local_path(m.target)) == shm_dir]
        opts = stack.volumes[mount.volume]["driver_opts"]
        assert opts["type"] == "tmpfs", f"{mount.volume} must live in memory"
        for runner in RUNNERS:
            if node in targets_of(stack, runner):
                assert mount in stack[runner].mounts, f"{runner} must mount {node}'s pool"
    assert targets_of(stack, "runner") == set(NODES)
    assert targets_of(stack, "chat-runner") == {"node-1"}


def test_the_disk_tier_is_opt_in_on_a_named_volume_per_node(tmp_path):
    stack = load_stack(tmp_path)  # as run with no overrides: memory only
    volumes = set()
    for node in NODES:
        assert stack[node].env["KVSTORE_DISK_PATH"] == "", "the default stays memory only"
        (disk,) = [m for m in stack[node].mounts if m.target == "/kvstore/disk"]
        assert stack.volumes[disk.volume] in ({}, None), f"{disk.volume}: on disk, not tmpfs"
        volumes.add(disk.volume)
        for runner in RUNNERS:
            assert disk not in stack[runner].mounts, "runners never read the disk tier's file"
    assert len(volumes) == len(NODES), "one tier file per node: two nodes on one file stop"
    with_disk = 'KVSTORE_DISK_PATH: "${KVSTORE_DISK_PATH:-}"'
    assert with_disk in COMPOSE.read_text(), "KVSTORE_DISK_PATH turns it on"


def test_ports_a_person_needs_are_published_on_loopback(tmp_path):
    stack = load_stack(tmp_path)
    for node in NODES:
        published = {container: host for _, host, container in stack[node].published}
        assert set(published) == {"50051", "9400"}, f"{node}: gRPC and metrics/web page"
        assert all(addr == "127.0.0.1" for addr, _, _ in stack[node].published)
    host_ports = [host for n in NODES for _, host, _ in stack[n].published]
    assert len(host_ports) == len(set(host_ports)), "two nodes cannot share a host port"


def test_host_ports_and_images_can_be_overridden_from_the_environment():
    """A busy port on a shared host, or a locally built image, needs no edit of the file."""
    text = COMPOSE.read_text()
    for var in (
        "KVSTORE_NODE1_PORT:-50051",
        "KVSTORE_NODE1_METRICS_PORT:-9400",
        "KVSTORE_NODE2_PORT:-50052",
        "KVSTORE_NODE2_METRICS_PORT:-9401",
        "KVSTORE_IMAGE:-kvstore:dev",
        "KVSTORE_HF_IMAGE:-kvstore:hf",
        "KVSTORE_REDIS_IMAGE:-redis:7-alpine",
        "KVSTORE_BASE_IMAGE:-python:3.11-slim",
        "KVSTORE_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu",
    ):
        assert "${" + var + "}" in text, var


@pytest.fixture(scope="module")
def running(tmp_path_factory) -> Iterator[Stack]:
    """Redis and both nodes, each in its own mount namespace, healthy."""
    reason = mount_namespaces_work()
    if reason:
        pytest.skip(reason)
    stack = load_stack(tmp_path_factory.mktemp("compose"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in ("redis", *NODES):
            proc = spawn(stack[name], isolated=True, log_name=name)
            procs.append(proc)
            wait_healthy(stack[name], proc)
        yield stack
    finally:
        for proc in reversed(procs):
            stop(proc)


def run(stack: Stack, service: Service, log_name: str, timeout: float) -> tuple[int, str]:
    """Run a runner to completion in its own mount namespace; its exit code and log."""
    proc = spawn(service, isolated=True, log_name=log_name)
    try:
        code = proc.wait(timeout)
    finally:
        stop(proc)
    return code, log_of(stack, log_name)


def test_runner_maps_both_nodes_pools_through_the_volumes(running: Stack):
    code, log = run(running, running["runner"], "runner", 90)
    assert code == 0, log
    assert "synthetic_runner: ok" in log and "through the pools, mapped" in log


def test_runner_without_the_pool_volume_is_told_what_is_wrong(running: Stack):
    service = running["runner"].without_volumes()
    code, log = run(running, service, "runner-without-volume", 90)
    assert code != 0, log
    pool_dir = running["node-1"].env["KVSTORE_SHM_DIR"]
    assert f"pool directory {pool_dir} does not exist in this process" in log, log
    assert "does not share the node's pool directory" in log
    assert "mount one tmpfs volume" in log


def test_chat_runner_reuses_prefill_through_node_1s_pool(running: Stack):
    code, log = run(running, running["chat-runner"], "chat-runner", 120)
    assert code == 0, log
    summary = json.loads(log[log.index("{") : log.rindex("}") + 1])
    assert summary["logits_match"] is True
    assert summary["prefill_tokens_saved"] > 0


def test_published_metrics_port_serves_metrics_and_the_web_page(running: Stack):
    port = running["node-1"].ports["9400"]  # published 127.0.0.1:9400 -> container 9400
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert b"kvstore_" in resp.read()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as resp:
        assert b"<html" in resp.read().lower()


def test_node_image_without_extras_has_no_torch(running: Stack):
    assert running["node-1"].extras == "" and running["runner"].extras == ""
    probe = dataclasses.replace(running["runner"], command=["python", "-c", "import torch"])
    code, log = run(running, probe, "torch-probe", 30)
    assert code != 0 and "image without extras" in log, log
