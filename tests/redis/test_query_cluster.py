"""QueryPrefix on a live Redis Cluster: namespaces in several slots, engines included."""

from __future__ import annotations

import json

import pytest

from kvstore.v1 import kvstore_pb2 as pb
from service.cluster.keys import Keys, key_slot, member
from tests.redis.rpc import Rpc, prompt
from tests.redis.server import REDIS_SERVER
from tests.waiting import until

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server on PATH")

KEYS = Keys("kvt")
MODELS = [f"query-model-{i}" for i in range(4)]


async def test_query_answers_across_slots_with_engines(cnodes, rc):
    a = await cnodes.start("node-a")
    b = await cnodes.start("node-b")
    namespaces: dict[str, tuple[str, list[bytes]]] = {}
    for i, model in enumerate(MODELS):
        ra, rb = Rpc(a.address), Rpc(b.address)
        try:
            ns = await ra.register(model)
            await rb.register(model)
            namespaces[model] = (ns, await ra.store(seed=i + 1, blocks=3 + i))
        finally:
            await ra.close()
            await rb.close()
    slots = {key_slot(KEYS.ns_alive(ns)) for ns, _ in namespaces.values()}
    assert len(slots) > 1  # the namespaces really live in different slots
    model = MODELS[0]
    ns, chain = namespaces[model]
    tag = KEYS.ns_tag(ns)

    async def both_alive() -> bool:
        return len(await rc.zrange(KEYS.ns_alive(ns), 0, -1)) == 2

    # Before both nodes' first heartbeat in the namespace, node-a's heartbeat would sweep
    # node-b's engine field as a dead node's (docs/events.md, "On Redis").
    await until(both_alive, what="both nodes' namespace heartbeats")
    await rc.hset(
        f"{tag}:engines",
        "node-b:vllm-0",
        json.dumps({"node": "node-b", "engine": "vllm-0", "medium": "GPU"}),
    )
    await rc.sadd(f"{tag}:e:node-b:vllm-0", *[member(h, "default") for h in chain])
    rb = Rpc(b.address)
    try:
        for i, name in enumerate(MODELS):
            expected = [("node-a", "kvstore", "", 3 + i)]
            if name == model:
                expected = [("node-a", "kvstore", "", 3), ("node-b", "GPU", "vllm-0", 3)]

            async def answered(name=name, i=i, expected=expected) -> bool:
                resp = await rb.stub.QueryPrefix(
                    pb.QueryPrefixRequest(model=name, token_ids=prompt(i + 1, 8)), timeout=5
                )
                got = [(h.node_id, h.tier, h.engine, h.matched_blocks) for h in resp.holders]
                return resp.source == "directory" and got == expected

            await until(answered, what=f"{name}'s holders")
    finally:
        await rb.close()
