"""Engine holdings in the ops tools: ``kvstore tree`` / ``kvstore blocks`` and the web page."""

from __future__ import annotations

import asyncio
import hashlib

from kvstore.v1 import kvstore_pb2 as pb
from service.ops.web import HitRateHistory, WebApp
from tests.cli.conftest import kvstore
from tests.redis.rpc import Rpc, prompt
from tests.vllm_events.fake_engine import FakeEngine, batch, stored
from tests.vllm_events.ingest import join, start_node
from tests.waiting import until


def eh(i: int) -> bytes:
    return hashlib.sha256(b"ops-%d" % i).digest()


async def test_tree_blocks_and_web_show_engine_holdings(server_config) -> None:
    engine = FakeEngine()
    server = await start_node(server_config, engine)
    rpc = Rpc(server.address)
    try:
        ns = await rpc.register()
        chain = await rpc.store(seed=4, blocks=3)
        index = server.node.engine_index
        assert index is not None
        engine.keep(0, batch([stored([eh(0), eh(1)], None, prompt(4, 2))]))
        await join(engine, index.engines["fake-0"], 1)
        await until(lambda: len(index.blocks("fake-0")) == 2, what="the engine's blocks")

        tree = await asyncio.to_thread(kvstore, "tree", ns, "--json", "-t", server.address)
        assert tree.code == 0, tree.stderr
        (root,) = tree.json()["roots"]
        assert root["blocks"] == 3 and root["engines"] == {"fake-0": 2}
        text = await asyncio.to_thread(kvstore, "tree", ns, "-t", server.address)
        assert "engine fake-0 2/3" in text.stdout

        blocks = await asyncio.to_thread(kvstore, "blocks", ns, "--json", "-t", server.address)
        held = {b["hash"]: b["engines"] for b in blocks.json()["blocks"]}
        assert held == {chain[0].hex(): ["fake-0"], chain[1].hex(): ["fake-0"], chain[2].hex(): []}

        web = WebApp(server.node, HitRateHistory(), lambda environ, start: [])
        doc = await asyncio.to_thread(web.tree, ns, 1000)
        assert doc["roots"][0]["engines"] == {"fake-0": 2}

        listed = await rpc.stub.ListBlocks(pb.ListBlocksRequest(namespace_id=ns), timeout=10)
        assert sorted(b.hash for b in listed.blocks if b.engines) == sorted(chain[:2])
    finally:
        await rpc.close()
        await server.stop(0.1)
        engine.close()
