"""Fixtures shared by every test package.

- ``server_config``: a small, fast `Config` (port 0, pools in a temp dir, no prefault).
- ``clock``: a `ManualClock` the server's store runs on; ``clock.advance(s)`` moves time.
- ``kv_server``: a started in-process `service.server.Server` (stopped after the test).
- ``channel`` / ``stub``: an aio channel to it and a raw ``KVStoreStub``.
- ``lease`` / ``namespace``: a lease of 60 s and a registered namespace (`RegisteredNamespace`).
- ``auth_config`` / ``auth_server`` / ``auth_stub``: the same node with the tenants of
  tests/tenants.py and an admin token.
- ``pki``: a CA, a server and a client certificate (tests/pki.py), once per module.
- ``redis_server``: a private redis-server process (skips without redis-server on PATH).
- ``kv_node`` / ``live_runners``: a real node process (SIGTERM at teardown, which must
  exit 0 and leave no pool files) and runner processes (tests/e2e/processes.py).

Constants and helpers the tests import live in modules, never here: tests/inproc.py
(the test layout, `ManualClock`), tests/tenants.py, tests/waiting.py (polling).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from benchmarks._server import ServerProcess
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.config import Config
from service.server import Server
from tests.e2e.processes import LiveRunner, shm_parent
from tests.inproc import BLOCK_BYTES, LAYOUT, ManualClock, RegisteredNamespace
from tests.pki import make_pki
from tests.redis.server import REDIS_SERVER, RedisServer
from tests.tenants import ADMIN_TOKEN, TENANTS_TOML

# --- the in-process node ---------------------------------------------------------------


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


@contextlib.asynccontextmanager
async def started(config: Config, clock: ManualClock) -> AsyncIterator[Server]:
    """An in-process node on ``config`` and ``clock``, stopped at the end."""
    server = Server(config, clock=clock, expiry_tick=0.02)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0.1)


@pytest.fixture
async def kv_server(server_config: Config, clock: ManualClock) -> AsyncIterator[Server]:
    async with started(server_config, clock) as server:
        yield server


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


# --- the in-process node with auth on -------------------------------------------------


@pytest.fixture
def auth_config(server_config: Config, tmp_path) -> Config:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS_TOML)
    return replace(server_config, tenants_file=str(path), admin_token=ADMIN_TOKEN)


@pytest.fixture
async def auth_server(auth_config: Config) -> AsyncIterator[Server]:
    async with started(auth_config, ManualClock()) as server:
        yield server


@pytest.fixture
async def auth_stub(auth_server: Server) -> AsyncIterator[kvstore_pb2_grpc.KVStoreStub]:
    async with grpc.aio.insecure_channel(auth_server.address) as ch:
        yield kvstore_pb2_grpc.KVStoreStub(ch)


# --- TLS and Redis ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("needs redis-server on PATH")
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


# --- real processes: a node, runners ---------------------------------------------------


@pytest.fixture
def kv_node() -> Iterator[ServerProcess]:
    """A kvstore server process, stopped with SIGTERM after the test."""
    with tempfile.TemporaryDirectory(prefix="kvstore-e2e-", dir=shm_parent()) as shm:
        server = ServerProcess.start(shm, capacity="64MiB", prefix_stem="kve2e")
        try:
            yield server
        finally:
            status = server.stop()
            leftovers = server.pool_files()
            log_tail = server.log_tail()
        assert status == 0, f"server exited with {status}:\n{log_tail}"
        assert leftovers == [], f"pool files left after shutdown: {leftovers}"


@pytest.fixture
def live_runners() -> Iterator[Callable[..., LiveRunner]]:
    """Start `LiveRunner`s; any still running at teardown is killed."""
    started: list[LiveRunner] = []

    def start(target: str, command: str, *args: str, **options: Any) -> LiveRunner:
        runner = LiveRunner(target, command, *args, **options)
        started.append(runner)
        return runner

    yield start
    for runner in started:
        runner.stop()
