"""QueryPrefix and POST /query on a standalone node: answered from its own store, peeked."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc
import pytest

from kvstore.client import Client, PrefixHolder
from kvstore.errors import NotFound
from kvstore.v1 import kvstore_pb2 as pb
from service.config import Config
from service.ops import query_http
from tests.inproc import BLOCK_SIZE, tenant
from tests.redis.server import free_port
from tests.replies import entries_of
from tests.stand_ins import stand_in_checksums

MODEL = "test-model"
PROMPT = list(range(1000, 1000 + 6 * BLOCK_SIZE + 2))
"""Six full blocks and a partial one."""


@pytest.fixture
def server_config(server_config: Config) -> Config:
    return replace(server_config, metrics_port=free_port())


async def store(stub, ns: str, tokens: list[int], who=()) -> list[bytes]:
    """Reserve and commit the full blocks of ``tokens`` (bytes do not matter here)."""
    lid = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=60), metadata=who)).lease_id
    res = await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=tokens), metadata=who, timeout=5
    )
    fresh = [e.hash for e in entries_of(res) if e.status == pb.RESERVE_STATUS_RESERVED]
    await stub.Commit(
        pb.CommitRequest(
            namespace_id=ns,
            lease_id=lid,
            packed_hashes=b"".join(fresh),
            packed_checksums=stand_in_checksums(b"".join(fresh)),
        ),
        metadata=who,
        timeout=5,
    )
    await stub.CloseLease(pb.CloseLeaseRequest(lease_id=lid), metadata=who)
    return [e.hash for e in entries_of(res)]


def post(port: int, body: object, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/query", data=data, headers=headers or {}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def apost(port: int, body: object, headers: dict[str, str] | None = None):
    # The node serves on this test's loop: the blocking call goes to a thread.
    return await asyncio.to_thread(post, port, body, headers)


def holders(resp) -> list[tuple[str, str, str, int, int]]:
    return [(h.node_id, h.tier, h.engine, h.matched_blocks, h.matched_tokens) for h in resp.holders]


async def test_query_answers_this_node_without_counting_a_hit(kv_server, stub, namespace):
    chain = await store(stub, namespace.id, PROMPT[: 4 * BLOCK_SIZE])
    table = kv_server.node.table(namespace.id)
    lru_before = table.lru_order()
    stats_before = await stub.Stats(pb.StatsRequest())
    resp = await stub.QueryPrefix(pb.QueryPrefixRequest(model=MODEL, token_ids=PROMPT), timeout=5)
    assert resp.namespace_id == namespace.id and resp.model == MODEL
    assert resp.tenant_id == "default" and resp.source == "local"
    assert resp.block_size == BLOCK_SIZE and resp.query_blocks == 6
    assert resp.query_tokens == len(PROMPT)
    assert holders(resp) == [("test-node", "kvstore", "", 4, 4 * BLOCK_SIZE)]
    assert resp.longest_matched == 4 * BLOCK_SIZE
    # Peeked: no hit counted, nothing moved in the LRU, nothing pinned.
    stats_after = await stub.Stats(pb.StatsRequest())
    assert list(stats_after.namespaces[0].tenants) == list(stats_before.namespaces[0].tenants)
    assert table.lru_order() == lru_before
    assert stats_after.namespaces[0].pinned == 0
    # The same by hashes, repeated and packed, and by namespace id.
    by_hash = await stub.QueryPrefix(
        pb.QueryPrefixRequest(namespace_id=namespace.id, block_hashes=chain), timeout=5
    )
    assert holders(by_hash) == [("test-node", "kvstore", "", 4, 4 * BLOCK_SIZE)]
    packed = await stub.QueryPrefix(
        pb.QueryPrefixRequest(model=MODEL, packed_hashes=b"".join(chain[:3])), timeout=5
    )
    assert holders(packed) == [("test-node", "kvstore", "", 3, 3 * BLOCK_SIZE)]
    assert packed.query_blocks == 3 and packed.query_tokens == 3 * BLOCK_SIZE


async def test_unserved_prompt_and_other_tenant_have_no_holders(stub, namespace):
    await store(stub, namespace.id, PROMPT)
    other = [t + 1 for t in PROMPT]
    resp = await stub.QueryPrefix(pb.QueryPrefixRequest(model=MODEL, token_ids=other), timeout=5)
    assert list(resp.holders) == [] and resp.longest_matched == 0 and resp.query_blocks == 6
    # Another tenant (by header or by tenant_id with auth off) never sees these blocks.
    bob = await stub.QueryPrefix(
        pb.QueryPrefixRequest(model=MODEL, token_ids=PROMPT), metadata=tenant("bob"), timeout=5
    )
    assert list(bob.holders) == [] and bob.tenant_id == "bob"
    named = await stub.QueryPrefix(
        pb.QueryPrefixRequest(model=MODEL, token_ids=PROMPT, tenant_id="bob"), timeout=5
    )
    assert list(named.holders) == [] and named.tenant_id == "bob"


@dataclass(frozen=True)
class Match:
    engine: str
    medium: str
    blocks: int


class StubEngineIndex:
    """The engine-event ingestion's contract: longest(namespace, scope, chain)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, int]] = []

    def longest(self, namespace_id, scope, chain):
        self.asked.append((namespace_id, scope, len(chain)))
        return [Match("vllm-0", "GPU", 5), Match("vllm-1", "CPU", 0)]


async def test_engines_of_this_node_are_holders_with_their_medium(kv_server, stub, namespace):
    await store(stub, namespace.id, PROMPT[: 2 * BLOCK_SIZE])
    index = StubEngineIndex()
    kv_server.node.engine_index = index
    resp = await stub.QueryPrefix(pb.QueryPrefixRequest(model=MODEL, token_ids=PROMPT), timeout=5)
    assert holders(resp) == [
        ("test-node", "GPU", "vllm-0", 5, 5 * BLOCK_SIZE),
        ("test-node", "kvstore", "", 2, 2 * BLOCK_SIZE),
    ]
    assert index.asked == [(namespace.id, "default", 6)]


def code_and_field(exc: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    return exc.code(), exc.details().split(":")[0]


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        (pb.QueryPrefixRequest(token_ids=[1]), grpc.StatusCode.INVALID_ARGUMENT, "model"),
        (pb.QueryPrefixRequest(model="nope", token_ids=[1]), grpc.StatusCode.NOT_FOUND, "no"),
        (pb.QueryPrefixRequest(namespace_id="zz", token_ids=[1]), grpc.StatusCode.INVALID_ARGUMENT,
         "namespace_id"),
        (pb.QueryPrefixRequest(namespace_id="0123456789abcdef", token_ids=[1]),
         grpc.StatusCode.NOT_FOUND, "'0123456789abcdef' is not registered"),
        (pb.QueryPrefixRequest(model=MODEL), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        (pb.QueryPrefixRequest(model=MODEL, token_ids=[1], block_hashes=[b"x" * 32]),
         grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        (pb.QueryPrefixRequest(model=MODEL, block_hashes=[b"short"]),
         grpc.StatusCode.INVALID_ARGUMENT, "block_hashes[0]"),
        (pb.QueryPrefixRequest(model=MODEL, packed_hashes=b"x" * 33),
         grpc.StatusCode.INVALID_ARGUMENT, "packed_hashes"),
        (pb.QueryPrefixRequest(model=MODEL, packed_hashes=b"x" * 32 * 257),
         grpc.StatusCode.INVALID_ARGUMENT, "packed_hashes"),
        (pb.QueryPrefixRequest(model=MODEL, token_ids=list(range(257 * BLOCK_SIZE))),
         grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        (pb.QueryPrefixRequest(model=MODEL, packed_token_ids=b"abc"),
         grpc.StatusCode.INVALID_ARGUMENT, "packed_token_ids"),
        (pb.QueryPrefixRequest(model=MODEL, token_ids=[1], tenant_id="bad name!"),
         grpc.StatusCode.INVALID_ARGUMENT, "tenant_id"),
        (pb.QueryPrefixRequest(model="other", namespace_id="0123456789abcdef", token_ids=[1]),
         grpc.StatusCode.NOT_FOUND, "'0123456789abcdef' is not registered"),
    ],
)  # fmt: skip
async def test_bad_input_is_invalid_argument_or_not_found(stub, namespace, request_, code, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.QueryPrefix(request_, timeout=5)
    got_code, got_field = code_and_field(err.value)
    assert got_code == code, err.value.details()
    assert got_field.startswith(field) or field in err.value.details(), err.value.details()


async def test_model_and_namespace_must_agree(stub, namespace):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.QueryPrefix(
            pb.QueryPrefixRequest(model="other", namespace_id=namespace.id, token_ids=[1]),
            timeout=5,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("model:")


async def test_http_query_gives_the_grpc_answer(kv_server, stub, namespace):
    chain = await store(stub, namespace.id, PROMPT[: 3 * BLOCK_SIZE])
    port = kv_server.metrics_port
    grpc_answer = await stub.QueryPrefix(
        pb.QueryPrefixRequest(model=MODEL, token_ids=PROMPT), timeout=5
    )
    status, doc = await apost(port, {"model": MODEL, "token_ids": PROMPT, "tenant_id": "default"})
    assert status == 200, doc
    assert doc["holders"] == [
        {
            "node_id": h.node_id,
            "address": h.address,
            "tier": h.tier,
            "engine": h.engine,
            "matched_blocks": h.matched_blocks,
            "matched_tokens": h.matched_tokens,
        }
        for h in grpc_answer.holders
    ]
    assert doc["longest_matched"] == 3 * BLOCK_SIZE and doc["query_blocks"] == 6
    assert doc["instances"] == {"test-node": {"longest_matched": 12, "kvstore": 12}}
    status, by_hash = await apost(
        port, {"namespace_id": namespace.id, "block_hashes": [h.hex() for h in chain]}
    )
    assert status == 200 and by_hash["holders"][0]["matched_blocks"] == 3
    status, bob = await apost(port, {"model": MODEL, "token_ids": PROMPT, "tenant_id": "bob"})
    assert status == 200 and bob["holders"] == []
    status, via_header = await apost(
        port, {"model": MODEL, "token_ids": PROMPT}, {"X-Kvstore-Tenant": "bob"}
    )
    assert status == 200 and via_header["tenant_id"] == "bob" and via_header["holders"] == []


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"not json", 400, "body"),
        ([1, 2], 400, "JSON object"),
        ({"model": MODEL, "token_ids": [1], "oops": 1}, 400, "oops"),
        ({"model": MODEL, "token_ids": "1 2 3"}, 400, "token_ids"),
        ({"model": MODEL, "token_ids": [-1]}, 400, "token_ids"),
        ({"model": MODEL, "token_ids": [1, True]}, 400, "token_ids"),
        ({"model": MODEL, "block_hashes": ["zz"]}, 400, "block_hashes"),
        ({"model": MODEL, "block_hashes": ["ab"]}, 400, "hashes"),
        ({"model": MODEL, "token_ids": [1], "lora_name": "x"}, 400, "lora_name"),
        ({"model": MODEL, "token_ids": [1], "block_size": 64}, 400, "block_size"),
        ({"model": 5, "token_ids": [1]}, 400, "model"),
        ({"token_ids": [1]}, 400, "model"),
        ({"model": "nope", "token_ids": [1]}, 404, "nope"),
        ({"model": MODEL}, 400, "token_ids"),
    ],
)
async def test_http_bad_input_is_400(kv_server, namespace, body, status, words):
    got, doc = await apost(kv_server.metrics_port, body)
    assert got == status, doc
    assert words in doc["error"]


async def test_http_query_is_post_only_and_bounded(kv_server, namespace):
    port = kv_server.metrics_port

    def get() -> int:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/query", timeout=10)
        except urllib.error.HTTPError as exc:
            return exc.code
        return 200

    assert await asyncio.to_thread(get) == 405
    limit = 4 * kv_server.node.config.max_request_bytes

    def announce_too_much() -> tuple[int, dict]:
        # Refused on its Content-Length, before the body is read (none is sent).
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.putrequest("POST", "/query")
            conn.putheader("Content-Length", str(limit + 1))
            conn.endheaders()
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    status, doc = await asyncio.to_thread(announce_too_much)
    assert status == 413 and "max_request_bytes" in doc["error"]


async def test_sdk_query_prefix(kv_server, stub, namespace):
    chain = await store(stub, namespace.id, PROMPT[: 2 * BLOCK_SIZE])
    async with Client(kv_server.address, map_pool=False) as client:
        by_tokens = await client.query_prefix(model=MODEL, tokens=PROMPT)
        by_hashes = await client.query_prefix(namespace_id=namespace.id, hashes=chain)
        with pytest.raises(ValueError, match="exactly one"):
            await client.query_prefix(model=MODEL)
        with pytest.raises(NotFound):
            await client.query_prefix(model="nope", tokens=PROMPT)
    expected = PrefixHolder("test-node", "", "kvstore", "", 2, 2 * BLOCK_SIZE)
    assert by_tokens.holders == (expected,) and by_hashes.holders == (expected,)
    assert (by_tokens.query_blocks, by_tokens.query_tokens) == (6, len(PROMPT))
    assert by_tokens.longest_matched == 8 and by_tokens.source == "local"
    assert by_hashes.namespace_id == namespace.id and by_hashes.tenant_id == "default"


async def run_cli(*args: str, stdin: str = "") -> tuple[int, str, str]:
    """``python -m kvstore.cli ARGS`` as a subprocess (the node serves on this loop)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvstore.cli", *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_cli_query(kv_server, stub, namespace, tmp_path):
    chain = await store(stub, namespace.id, PROMPT[: 5 * BLOCK_SIZE])
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(PROMPT))
    target = ("--target", kv_server.address)
    code, out, err = await run_cli("query", "--model", MODEL, "--tokens-file", str(tokens),
                                   "--json", *target)  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert [(h["node_id"], h["matched_blocks"]) for h in doc["holders"]] == [("test-node", 5)]
    assert doc["query_blocks"] == 6 and doc["longest_matched"] == 5 * BLOCK_SIZE
    # Hashes on stdin, a table for people.
    hashes = "\n".join(h.hex() for h in chain[:2])
    code, out, err = await run_cli("query", "--namespace", namespace.id, "--hashes-file", "-",
                                   *target, stdin=hashes)  # fmt: skip
    assert code == 0, err
    assert "test-node" in out and "kvstore" in out and " 8" in out
    code, out, err = await run_cli("query", "--model", "nope", "--tokens-file", "-", *target,
                                   stdin="1 2 3 4")  # fmt: skip
    assert code == 1 and "NOT_FOUND" in err and "nope" in err
    code, _, err = await run_cli("query", "--model", MODEL, *target)
    assert code == 2 and "exactly one" in err


def post_answer(port: int, body: object) -> tuple[int, dict, dict[str, str]]:
    """``post``, with the answer's headers."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/query", data=json.dumps(body).encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


async def test_http_query_answers_503_with_retry_after_when_the_loop_stalls(
    kv_server, stub, namespace, monkeypatch, caplog
):
    """#31 item 7: a loop that does not answer within the wait was the web layer's
    catch-all (a logged traceback, ``{"error": "TimeoutError()"}``, no Retry-After)."""
    await store(stub, namespace.id, PROMPT[: 3 * BLOCK_SIZE])
    monkeypatch.setattr(query_http, "ANSWER_TIMEOUT", 0.2)
    body = {"model": MODEL, "token_ids": PROMPT, "tenant_id": "default"}
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(post_answer, kv_server.metrics_port, body)
        time.sleep(1.5)  # noqa: ASYNC251 (on purpose: stall the node's loop, this test's)
        status, doc, headers = asked.result(timeout=10)
    assert status == 503, doc
    assert headers.get("Retry-After") == "1"
    assert "did not answer within 0.2 s" in doc["error"], doc
    assert "web request /query failed" not in caplog.text  # an answer, not a bug
    monkeypatch.setattr(query_http, "ANSWER_TIMEOUT", 30.0)
    status, doc, _ = await asyncio.to_thread(post_answer, kv_server.metrics_port, body)
    assert status == 200 and doc["longest_matched"] == 3 * BLOCK_SIZE  # and it serves again
