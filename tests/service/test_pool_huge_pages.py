"""The node's pool_huge_pages setting: parsed, enforced at start, reported as a metric."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from kvstore.pool import host_pages
from kvstore.pool.host_pages import HugePageSupport
from kvstore.types import NamespaceId
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.config import Config, ConfigError, load_config
from service.memory.budget import PoolManager
from service.server import Server
from tests.inproc import LAYOUT


def test_the_setting_takes_auto_on_off_only() -> None:
    assert load_config([], {}).pool_huge_pages == "auto"
    assert load_config(["--pool-huge-pages", "OFF"], {}).pool_huge_pages == "off"
    assert load_config([], {"KVSTORE_POOL_HUGE_PAGES": "on"}).pool_huge_pages == "on"
    with pytest.raises(ConfigError, match="auto, on or off"):
        load_config(["--pool-huge-pages", "always"], {})


def _offer(monkeypatch: pytest.MonkeyPatch, possible: bool) -> None:
    monkeypatch.setattr(
        host_pages, "support", lambda directory: HugePageSupport(possible, "simulated kernel")
    )


def test_on_where_the_kernel_offers_none_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _offer(monkeypatch, possible=False)
    config = replace(load_config([], {}), shm_dir=str(tmp_path), pool_huge_pages="on")
    with pytest.raises(ConfigError, match="simulated kernel"):
        PoolManager(config)
    PoolManager(replace(config, pool_huge_pages="auto"))  # auto falls back: starts


def test_the_manager_sums_the_huge_page_bytes_of_its_pools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = replace(load_config([], {}), shm_dir=str(tmp_path), capacity_bytes=1 << 20)
    manager = PoolManager(config)
    ns = NamespaceId("00112233aabbccdd")
    plan = manager.plan(4096, 1 << 16)
    assert manager.promise(plan.arena_bytes)
    arena = manager.build_arena(ns, plan, manager.next_serial())
    monkeypatch.setattr(type(arena), "huge_page_bytes", property(lambda self: 8192))
    manager.adopt(ns, arena, plan)
    try:
        assert manager.huge_page_bytes == 8192
    finally:
        manager.discard(ns)
    assert manager.huge_page_bytes == 0


def _huge_tmpfs() -> str | None:
    """A writable tmpfs mounted with huge pages here (the huge case skips without one)."""
    mounts = Path("/proc/self/mounts")
    for line in mounts.read_text().splitlines() if mounts.exists() else []:
        parts = line.split()
        huge = len(parts) > 3 and parts[2] == "tmpfs" and "huge=" in parts[3]
        if huge and "huge=never" not in parts[3] and os.access(parts[1], os.W_OK):
            return parts[1]
    return None


@pytest.mark.parametrize(
    "huge_dir",
    [
        None,
        pytest.param(
            _huge_tmpfs(),
            marks=pytest.mark.skipif(_huge_tmpfs() is None, reason="no huge-page tmpfs here"),
        ),
    ],
    ids=["small-pages", "huge-page-tmpfs"],
)
async def test_the_node_exports_the_huge_page_bytes_of_its_pools(
    server_config: Config, tmp_path: Path, huge_dir: str | None
) -> None:
    if huge_dir is not None:
        shm = tempfile.mkdtemp(dir=huge_dir)
        config = replace(
            server_config,
            shm_dir=shm,
            pool_prefault=True,
            pool_huge_pages="on",
            arena_bytes=2 << 20,
            capacity_bytes=4 << 20,
            namespace_capacity_bytes=0,
        )
    else:
        config = replace(server_config, pool_prefault=True, arena_bytes=2 << 20,
                         capacity_bytes=4 << 20, namespace_capacity_bytes=0)  # fmt: skip
    server = Server(config)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            await stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(model_id="m", layout=LAYOUT), timeout=5
            )
        text = generate_latest(server.node.metrics.registry).decode()
        value = float(re.search(r"^kvstore_node_huge_page_bytes (\S+)$", text, re.M)[1])  # type: ignore[index]
        assert value == (2 << 20 if huge_dir is not None else 0)
    finally:
        await server.stop(0.1)
        if huge_dir is not None:
            shutil.rmtree(config.shm_dir, ignore_errors=True)
