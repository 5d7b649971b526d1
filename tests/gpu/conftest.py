"""GPU tests: marked ``cuda``; the whole package skips without cupy or without a GPU."""

from __future__ import annotations

import pytest


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
