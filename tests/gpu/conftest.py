"""GPU tests: marked ``cuda``; the whole package skips without cupy or without a GPU.

``node``: a CUDA node process (tests/gpu/node.py), stopped after the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gpu.node import Node


def gpu_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    try:
        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # no driver: cupy raises CUDARuntimeError
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs cupy and an NVIDIA GPU (pip install 'kvstore[cuda]')")
    available = None
    for item in items:
        if "tests/gpu/" not in str(item.fspath).replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.cuda)
        if available is None:
            available = gpu_available()
        if not available:
            item.add_marker(skip)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    try:
        yield n
    finally:
        n.stop()
