"""Fixtures of the pool tests: tiny pools in a private temporary directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.layout import KVLayout
from kvstore.pool import HostPool
from kvstore.types import NamespaceId

NS = NamespaceId("00112233aabbccdd")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float16")
"""256-byte blocks: pools of a few KiB keep the tests far under their memory budget."""


@pytest.fixture
def pool_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "shm"
    directory.mkdir()
    return directory


@pytest.fixture
def pool(pool_dir: Path) -> Iterator[HostPool]:
    """10 slots of 256 bytes, 4 slots per arena: arenas of 4, 4 and 2 slots."""
    p = HostPool.create(
        NS, LAYOUT.block_bytes, 10, 0xABC, directory=str(pool_dir), arena_bytes=4 * 256 + 100
    )
    yield p
    p.close()
