"""Who may ask a prefix query about which tenant, with auth on (gRPC and POST /query)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import replace

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from service.config import Config
from tests.inproc import BLOCK_SIZE
from tests.redis.server import free_port
from tests.tenants import (
    ADMIN_TOKEN,
    ALICE_TOKEN,
    BOB_TOKEN,
    MODEL,
    OTHER_MODEL,
    bearer,
    open_lease,
    register,
    store,
)

TOKENS = list(range(500, 500 + 3 * BLOCK_SIZE))


@pytest.fixture
def server_config(server_config: Config) -> Config:
    return replace(server_config, metrics_port=free_port())


@pytest.fixture
async def alice_blocks(auth_stub) -> str:
    ns = (await register(auth_stub, ALICE_TOKEN)).namespace_id
    await store(auth_stub, ALICE_TOKEN, ns, await open_lease(auth_stub, ALICE_TOKEN), TOKENS)
    return ns


async def ask(stub, token: str | None, **fields) -> pb.QueryPrefixResponse:
    fields.setdefault("model", MODEL)
    return await stub.QueryPrefix(
        pb.QueryPrefixRequest(token_ids=TOKENS, **fields),
        metadata=bearer(token) if token else (),
        timeout=5,
    )


async def refused(stub, token: str | None, **fields) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ask(stub, token, **fields)
    return err.value.code()


async def test_a_tenant_asks_about_itself_and_the_admin_about_anyone(auth_stub, alice_blocks):
    own = await ask(auth_stub, ALICE_TOKEN)
    assert own.tenant_id == "alice" and [h.matched_blocks for h in own.holders] == [3]
    assert (await ask(auth_stub, ALICE_TOKEN, tenant_id="alice")).holders == own.holders
    by_admin = await ask(auth_stub, ADMIN_TOKEN, tenant_id="alice")
    assert by_admin.tenant_id == "alice" and by_admin.holders == own.holders
    bob = await ask(auth_stub, BOB_TOKEN)
    assert bob.tenant_id == "bob" and list(bob.holders) == []
    assert await refused(auth_stub, ALICE_TOKEN, tenant_id="bob") == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert await refused(auth_stub, BOB_TOKEN, tenant_id="alice") == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert await refused(auth_stub, ADMIN_TOKEN) == grpc.StatusCode.INVALID_ARGUMENT
    assert await refused(auth_stub, ADMIN_TOKEN, tenant_id="carol") == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert await refused(auth_stub, None) == grpc.StatusCode.UNAUTHENTICATED
    assert await refused(auth_stub, "wrong-token") == grpc.StatusCode.UNAUTHENTICATED


async def test_a_tenant_may_not_ask_about_a_model_it_may_not_use(auth_stub, alice_blocks):
    await register(auth_stub, BOB_TOKEN, OTHER_MODEL)
    assert await refused(auth_stub, ALICE_TOKEN, model=OTHER_MODEL) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert list((await ask(auth_stub, BOB_TOKEN, model=OTHER_MODEL)).holders) == []


def _post(port: int, body: dict, token: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/query",
        data=json.dumps(body).encode(),
        headers=headers,
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_http_query_takes_the_same_tokens(auth_server, alice_blocks):
    port = auth_server.metrics_port

    async def post(body: dict, token: str | None) -> tuple[int, dict]:
        return await asyncio.to_thread(_post, port, body, token)

    body = {"model": MODEL, "token_ids": TOKENS}
    status, doc = await post(body, ALICE_TOKEN)
    assert status == 200 and doc["tenant_id"] == "alice" and doc["longest_matched"] == 12
    status, doc = await post({**body, "tenant_id": "alice"}, ADMIN_TOKEN)
    assert status == 200 and doc["longest_matched"] == 12
    assert (await post(body, None))[0] == 401
    assert (await post(body, "wrong-token"))[0] == 401
    assert (await post({**body, "tenant_id": "bob"}, ALICE_TOKEN))[0] == 403
    assert (await post(body, ADMIN_TOKEN))[0] == 400
    # The tenant header is ignored with auth on: the token decides.
    status, doc = await asyncio.to_thread(_post_with_header, port, body, ALICE_TOKEN)
    assert status == 200 and doc["tenant_id"] == "alice"


def _post_with_header(port: int, body: dict, token: str) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/query",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "X-Kvstore-Tenant": "bob"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, json.loads(resp.read())
