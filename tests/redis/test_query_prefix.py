"""QueryPrefix and POST /query on two nodes and a private Redis: the cluster's answer."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from service.cluster.keys import Keys, member
from tests.inproc import BLOCK_SIZE
from tests.redis.rpc import MODEL, Rpc, prompt
from tests.redis.server import free_port
from tests.waiting import until

KEYS = Keys("kvt")


@pytest.fixture
async def pair(nodes, rclient):
    """Nodes a and b (HTTP on), alive in the model's namespace; a stores prompt 1's 6 blocks."""
    a = await nodes.start("node-a", metrics_port=free_port())
    b = await nodes.start("node-b", metrics_port=free_port())
    ra, rb = Rpc(a.address), Rpc(b.address)
    try:
        ns = await ra.register()
        await rb.register()
        chain = await ra.store(seed=1, blocks=6)

        async def both_alive() -> bool:
            return len(await rclient.zrange(KEYS.ns_alive(ns), 0, -1)) == 2

        await until(both_alive, what="both nodes' namespace heartbeats")
        yield a, b, ra, rb, ns, chain
    finally:
        await ra.close()
        await rb.close()


async def query(rpc: Rpc, tokens: list[int], **fields) -> pb.QueryPrefixResponse:
    fields.setdefault("model", MODEL)
    return await rpc.stub.QueryPrefix(
        pb.QueryPrefixRequest(token_ids=tokens, **fields), metadata=rpc.md, timeout=5
    )


def holders(resp) -> list[tuple[str, str, str, int, int]]:
    return [(h.node_id, h.tier, h.engine, h.matched_blocks, h.matched_tokens) for h in resp.holders]


async def holders_of(rpc: Rpc, tokens: list[int]) -> list[tuple[str, str, str, int, int]]:
    return holders(await query(rpc, tokens))


async def settled(rpc: Rpc, tokens: list[int], expected, what: str):
    """Wait until the directory (flushed in batches) gives ``expected``."""

    async def check() -> bool:
        return await holders_of(rpc, tokens) == expected

    await until(check, what=what)


async def test_both_nodes_answer_the_cluster_longest_first(pair):
    a, _b, ra, rb, ns, chain = pair
    tokens = prompt(1, 8)
    await settled(rb, tokens, [("node-a", "kvstore", "", 6, 24)], "node-a's 6 blocks via node-b")
    resp = await query(rb, tokens)
    assert resp.source == "directory" and resp.namespace_id == ns
    assert resp.query_blocks == 8 and resp.block_size == BLOCK_SIZE
    assert [h.address for h in resp.holders] == [a.address]
    assert resp.longest_matched == 6 * BLOCK_SIZE
    # Node b caches a shorter prefix: both listed, longest first, from either node.
    await rb.store(seed=1, blocks=3)
    both = [("node-a", "kvstore", "", 6, 24), ("node-b", "kvstore", "", 3, 12)]
    await settled(rb, tokens, both, "both nodes")
    assert await holders_of(ra, tokens) == both
    # By hashes (the chain itself) the answer is the same.
    by_hash = await rb.stub.QueryPrefix(
        pb.QueryPrefixRequest(namespace_id=ns, packed_hashes=b"".join(chain)), timeout=5
    )
    assert holders(by_hash) == both and by_hash.query_blocks == 6
    # A prompt nobody served has no holders.
    assert await holders_of(rb, prompt(9, 8)) == []


async def test_tenants_never_see_each_others_blocks(pair):
    _a, b, ra, rb, _ns, _chain = pair
    tokens = prompt(1, 6)
    await settled(rb, tokens, [("node-a", "kvstore", "", 6, 24)], "default's blocks")
    bob = Rpc(b.address, tenant="bob")
    try:
        assert await holders_of(bob, tokens) == []
        await bob.register()
        await bob.store(seed=1, blocks=2)  # the same tokens, bob's chain and scope
        await settled(bob, tokens, [("node-b", "kvstore", "", 2, 8)], "bob's own blocks")
        # tenant_id with auth off names the tenant too; default's view is unchanged.
        named = await query(ra, tokens, tenant_id="bob")
        assert holders(named) == [("node-b", "kvstore", "", 2, 8)] and named.tenant_id == "bob"
        assert await holders_of(ra, tokens) == [("node-a", "kvstore", "", 6, 24)]
    finally:
        await bob.close()


async def test_a_silent_node_drops_out_when_its_deadline_passes(pair, rclient):
    _a, _b, _ra, rb, ns, chain = pair
    tokens = prompt(1, 6)
    await settled(rb, tokens, [("node-a", "kvstore", "", 6, 24)], "node-a")
    # A node that stopped heartbeating: its deadline is 2 s from now, its set stays.
    now_ms = int(time.time() * 1000)
    await rclient.zadd(KEYS.ns_alive(ns), {"ghost": now_ms + 2000})
    await rclient.hset(KEYS.ns_addr(ns), "ghost", "10.0.0.9:1")
    await rclient.sadd(KEYS.ns_node(ns, "ghost"), *[member(h, "default") for h in chain[:4]])
    with_ghost = await holders_of(rb, tokens)
    assert ("ghost", "kvstore", "", 4, 16) in with_ghost
    await settled(rb, tokens, [("node-a", "kvstore", "", 6, 24)], "the ghost to drop out")
    assert await rclient.exists(KEYS.ns_node(ns, "ghost"))  # still there: liveness decides


async def test_engines_of_live_nodes_count_with_their_medium(pair, rclient):
    a, b, _ra, rb, ns, chain = pair
    tokens = prompt(1, 8)
    await settled(rb, tokens, [("node-a", "kvstore", "", 6, 24)], "node-a")
    tag = KEYS.ns_tag(ns)

    async def engine(node: str, name: str, medium: str, blocks: list[bytes], scope="default"):
        info = json.dumps({"node": node, "engine": name, "medium": medium})
        await rclient.hset(f"{tag}:engines", f"{node}:{name}", info)
        if blocks:
            await rclient.sadd(f"{tag}:e:{node}:{name}", *[member(h, scope) for h in blocks])

    await engine("node-b", "vllm-0", "GPU", chain[:5])
    await engine("node-a", "vllm-1", "CPU", chain[:2] + chain[3:])  # a gap: 2 count
    await engine("node-b", "vllm-2", "GPU", chain, scope="bob")  # another tenant's
    await engine("node-gone", "vllm-3", "GPU", chain)  # its node is not alive
    await rclient.hset(f"{tag}:engines", "node-b:broken", "not json")
    await rclient.sadd(f"{tag}:e:node-b:broken", *[member(h, "default") for h in chain])
    resp = await query(rb, tokens)
    assert holders(resp) == [
        ("node-a", "kvstore", "", 6, 24),
        ("node-b", "GPU", "vllm-0", 5, 20),
        ("node-a", "CPU", "vllm-1", 2, 8),
    ]
    assert [h.address for h in resp.holders] == [a.address, b.address, a.address]
    # Over HTTP: the same holders, and Conductor's per-instance view.
    status, doc = await post(b.metrics_port, {"model": MODEL, "token_ids": tokens})
    assert status == 200, doc
    assert [
        (h["node_id"], h["tier"], h["engine"], h["matched_blocks"], h["matched_tokens"])
        for h in doc["holders"]
    ] == holders(resp)
    assert doc["source"] == "directory" and doc["longest_matched"] == 24
    assert doc["instances"] == {
        "node-a": {"longest_matched": 24, "kvstore": 24},
        "node-b/vllm-0": {"longest_matched": 20, "GPU": 20},
        "node-a/vllm-1": {"longest_matched": 8, "CPU": 8},
    }


def _post(port: int, body: object) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/query", data=json.dumps(body).encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def post(port: int, body: object) -> tuple[int, dict]:
    return await asyncio.to_thread(_post, port, body)  # the node serves on this loop


async def test_http_matches_grpc_and_bad_input_is_400(pair):
    a, b, _ra, rb, _ns, chain = pair
    tokens = prompt(1, 7)
    await settled(rb, tokens, [("node-a", "kvstore", "", 6, 24)], "node-a")
    status, doc = await post(b.metrics_port, {"model": MODEL, "token_ids": tokens})
    assert status == 200
    assert doc["holders"] == [
        {
            "node_id": "node-a",
            "address": a.address,
            "tier": "kvstore",
            "engine": "",
            "matched_blocks": 6,
            "matched_tokens": 24,
        }
    ]
    assert (doc["query_blocks"], doc["query_tokens"], doc["block_size"]) == (7, 28, BLOCK_SIZE)
    for body, code, words in (
        ({"model": "unknown-model", "token_ids": tokens}, 404, "unknown-model"),
        ({"model": MODEL, "token_ids": tokens, "block_hashes": [chain[0].hex()]}, 400, "either"),
        ({"model": MODEL, "block_hashes": ["00" * 31]}, 400, "hashes"),
        ({"model": MODEL, "token_ids": list(range(1025 * BLOCK_SIZE))}, 400, "max_chain_blocks"),
        ({"model": MODEL, "token_ids": tokens, "tenant_id": "no spaces"}, 400, "tenant_id"),
    ):
        status, doc = await post(b.metrics_port, body)
        assert status == code and words in doc["error"], (body.keys(), doc)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await query(rb, [], block_hashes=[b"x" * 31])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_redis_away_answers_from_this_node(pair, redis_server):
    a, _b, ra, rb, _ns, _chain = pair
    tokens = prompt(1, 6)
    await settled(rb, tokens, [("node-a", "kvstore", "", 6, 24)], "node-a")
    redis_server.kill()
    resp = await query(ra, tokens)
    assert resp.source == "local"
    assert holders(resp) == [("node-a", "kvstore", "", 6, 24)]
    assert [h.address for h in resp.holders] == [a.address]
    assert holders(await query(rb, tokens)) == []  # b alone holds nothing
