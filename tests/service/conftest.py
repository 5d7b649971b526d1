"""Fixtures that start a real in-process kvstore server on a free port.

Reusable by other test packages (import them from here or copy the pattern):

- ``server_config``: a small, fast `Config` (port 0, pools in a temp dir, no prefault).
- ``clock``: a `ManualClock` the server's store runs on; ``clock.advance(s)`` moves time.
- ``kv_server``: a started `service.server.Server` (stopped after the test).
- ``channel`` / ``stub``: an aio channel to it and a raw ``KVStoreStub``.
- ``namespace``: a registered namespace (`RegisteredNamespace`) with a small layout.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.config import Config
from service.server import Server

BLOCK_SIZE = 4
"""Tokens per block of the test layout."""

LAYOUT = pb.KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=4, block_size=BLOCK_SIZE, dtype="float16"
)
"""A tiny layout: 2 * 2 layers * 4 tokens * 2 heads * 4 dims * 2 bytes = 256 bytes a block."""

BLOCK_BYTES = 256


class ManualClock:
    """Monotonic time plus an offset that tests can push forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        """Move the server's notion of now forward by ``seconds``."""
        self.offset += seconds


def tenant(name: str) -> tuple[tuple[str, str], ...]:
    """Call metadata naming a tenant."""
    return (("x-kvstore-tenant", name),)


@dataclass
class RegisteredNamespace:
    """A namespace registered on the test server."""

    id: str
    block_bytes: int
    capacity: int
    chain_root: bytes


@pytest.fixture
def server_config(tmp_path) -> Config:
    return Config(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        capacity_bytes=1 << 20,
        namespace_capacity_bytes=64 * BLOCK_BYTES,
        arena_bytes=16 * BLOCK_BYTES,
        # Pools grow on need only: the tests of budgets count arenas (the
        # headroom has its own tests, tests/service/test_pool_headroom.py).
        pool_headroom_bytes=0,
        shm_dir=str(tmp_path),
        pool_prefix=f"kvtest{uuid.uuid4().hex[:8]}",
        pool_prefault=False,
        node_id="test-node",
        salt_secret=bytes(range(32)),
        grace_seconds=0.1,
        max_message_bytes=1 << 20,
        max_chain_blocks=256,
    )


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def kv_server(server_config: Config, clock: ManualClock) -> AsyncIterator[Server]:
    server = Server(server_config, clock=clock, expiry_tick=0.02)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0.1)


@pytest.fixture
async def channel(kv_server: Server) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(
        kv_server.address, options=[("grpc.max_receive_message_length", 8 << 20)]
    ) as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> kvstore_pb2_grpc.KVStoreStub:
    return kvstore_pb2_grpc.KVStoreStub(channel)


@pytest.fixture
async def lease(stub) -> int:
    """A lease of 60 s on the node (the manual clock does not move by itself)."""
    return int((await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=60))).lease_id)


@pytest.fixture
async def namespace(stub) -> RegisteredNamespace:
    resp = await stub.RegisterNamespace(
        pb.RegisterNamespaceRequest(model_id="test-model", layout=LAYOUT), timeout=5
    )
    return RegisteredNamespace(
        resp.namespace_id, resp.block_bytes, resp.capacity_blocks, resp.chain_root
    )
