"""Client tests run against the real in-process server of ``tests/service``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvstore.client import Client
from kvstore.layout import KVLayout
from service.server import Server
from tests.service.conftest import clock, kv_server, server_config  # noqa: F401

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float16")
"""256-byte blocks, as in the service tests."""


@pytest.fixture
async def kv(kv_server: Server) -> AsyncIterator[Client]:  # noqa: F811
    async with Client(kv_server.address, tenant="acme", timeout=5.0) as client:
        yield client
