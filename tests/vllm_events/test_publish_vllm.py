"""The node's own block events, decoded by vLLM's classes in vLLM's python.

A router built on vLLM's ``KVEventBatch`` decoder must read what the node
publishes: BlockStored with the node's 32-byte chain hashes, the namespace's
block size, no token ids; BlockRemoved of evicted blocks; sequence numbers
0, 1, 2, ...; a replay socket that resends from a sequence number.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
from prometheus_client import generate_latest

from kvstore.v1 import kvstore_pb2 as pb
from service.server import Server
from tests.inproc import BLOCK_SIZE
from tests.redis.rpc import Rpc
from tests.vllm_events.ingest import read_line, stop
from tests.vllm_events.vllm_side import start, vllm_python

pytestmark = pytest.mark.skipif(vllm_python() is None, reason="needs KVSTORE_VLLM_PYTHON")


async def test_vllm_decodes_published_events(server_config) -> None:
    config = replace(
        server_config,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        kv_events_topic="kvstore",
    )
    server = Server(config, expiry_tick=0.02)
    await server.start()
    rpc = Rpc(server.address)
    publisher = server.node.kv_events.publisher
    assert publisher is not None
    proc = None
    try:
        await rpc.register()
        first = await rpc.store(seed=1, blocks=3)  # batch 0: before anyone listens
        python = vllm_python()
        assert python is not None
        proc = start(python, "decode", publisher.endpoint, publisher.replay_endpoint)
        deadline = time.monotonic() + 120  # importing vLLM is slow on a busy host
        replayed = []
        while (line := await read_line(proc, deadline)) != "ready":
            replayed.append(json.loads(line))
        assert [b["seq"] for b in replayed] == [0]
        (stored,) = replayed[0]["events"]
        assert stored["type"] == "BlockStored"
        assert stored["block_hashes"] == [h.hex() for h in first]
        assert stored["parent_block_hash"] is None
        assert stored["token_ids"] == []
        assert stored["block_size"] == BLOCK_SIZE
        assert stored["medium"] == "CPU_kvstore"

        # Live: the SUB socket joins asynchronously, so store new prompts until one arrives.
        live = None
        seed = 10
        stored_live: set[str] = set()
        while live is None:
            seed += 1
            chain = await rpc.store(seed=seed, blocks=2)
            stored_live.update(h.hex() for h in chain)
            try:
                live = json.loads(await read_line(proc, min(deadline, time.monotonic() + 0.5)))
            except TimeoutError:
                continue
        assert live["replayed"] is False
        seen = {h for e in live["events"] for h in e["block_hashes"]}
        assert seen and seen <= stored_live

        # Evict everything: BlockRemoved of the evicted blocks, next sequence numbers.
        await rpc.stub.Clear(pb.ClearRequest(namespace_id=rpc.namespace), timeout=10)
        removed: set[str] = set()
        seqs = [live["seq"]]
        want = {h.hex() for h in first} | {h.hex() for h in chain}
        while not want <= removed:
            batch = json.loads(await read_line(proc, deadline))
            seqs.append(batch["seq"])
            for e in batch["events"]:
                assert e["type"] in ("BlockStored", "BlockRemoved")
                if e["type"] == "BlockRemoved":
                    assert e["medium"] == "CPU_kvstore"
                    removed.update(e["block_hashes"])
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert publisher.dropped == 0
        scrape = generate_latest(server.node.metrics.registry).decode()
        assert f"kvstore_kv_events_published_batches_total {float(publisher.sent)}" in scrape
    finally:
        if proc is not None:
            stop(proc)
        await rpc.close()
        await server.stop(0.1)
