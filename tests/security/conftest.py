"""A node with auth on: a tenants file, an admin token and a cluster-token-less config."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.config import Config
from service.server import Server
from tests.replies import entries_of
from tests.service.conftest import LAYOUT, ManualClock, server_config  # noqa: F401

ALICE_TOKEN = "alice-token-0123456789"
BOB_TOKEN = "bob-token-0123456789abc"
ADMIN_TOKEN = "admin-token-0123456789"
MODEL = "test-model"
OTHER_MODEL = "other-model"

TENANTS_TOML = f"""
[tenants.alice]
tokens = ["{ALICE_TOKEN}"]
namespaces = ["{MODEL}"]
max_blocks = 6
max_leases = 2

[tenants.bob]
token_sha256 = ["{hashlib.sha256(BOB_TOKEN.encode()).hexdigest()}"]
namespaces = ["*"]
"""


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a token."""
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture
def auth_config(server_config: Config, tmp_path) -> Config:  # noqa: F811
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS_TOML)
    return replace(server_config, tenants_file=str(path), admin_token=ADMIN_TOKEN)


@pytest.fixture
async def auth_server(auth_config: Config) -> AsyncIterator[Server]:
    server = Server(auth_config, clock=ManualClock(), expiry_tick=0.02)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0.1)


@pytest.fixture
async def auth_stub(auth_server: Server) -> AsyncIterator[kvstore_pb2_grpc.KVStoreStub]:
    async with grpc.aio.insecure_channel(auth_server.address) as ch:
        yield kvstore_pb2_grpc.KVStoreStub(ch)


async def register(stub, token: str, model: str = MODEL) -> pb.RegisterNamespaceResponse:
    """Register ``model`` as the tenant of ``token``."""
    return await stub.RegisterNamespace(
        pb.RegisterNamespaceRequest(model_id=model, layout=LAYOUT),
        metadata=bearer(token),
        timeout=5,
    )


async def open_lease(stub, token: str) -> int:
    resp = await stub.OpenLease(pb.OpenLeaseRequest(), metadata=bearer(token), timeout=5)
    return resp.lease_id


async def store(stub, token: str, ns: str, lease: int, tokens: list[int]) -> list[bytes]:
    """Reserve and commit the blocks of ``tokens``; returns the chain."""
    resp = await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns, lease_id=lease, tokens=tokens),
        metadata=bearer(token),
        timeout=5,
    )
    hashes = [e.hash for e in entries_of(resp) if e.status == pb.RESERVE_STATUS_RESERVED]
    if hashes:
        await stub.Commit(
            pb.CommitRequest(namespace_id=ns, lease_id=lease, packed_hashes=b"".join(hashes)),
            metadata=bearer(token),
            timeout=5,
        )
    return [e.hash for e in entries_of(resp)]
