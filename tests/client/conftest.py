"""Client tests run against the real in-process server (``kv_server``, tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvstore.client import Client
from service.server import Server


@pytest.fixture
async def kv(kv_server: Server) -> AsyncIterator[Client]:
    async with Client(kv_server.address, tenant="acme", timeout=5.0) as client:
        yield client
