"""The node's pool_huge_pages setting: parsed, enforced at start, reported as a metric."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.pool import host_pages
from kvstore.pool.host_pages import HugePageSupport
from kvstore.types import NamespaceId
from service.config import ConfigError, load_config
from service.pools import PoolManager


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
