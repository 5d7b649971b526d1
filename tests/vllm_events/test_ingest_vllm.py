"""Ingesting the events of vLLM's own ``ZmqEventPublisher`` (in vLLM's python).

No engine runs: the publisher is driven with vLLM's event classes, exactly
what an engine started with ``--kv-events-config`` sends.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from dataclasses import replace

import pytest

from service.config.engines import EngineSource
from service.server import Server
from service.vllm_events.engine_index import EngineMatch
from tests.redis.rpc import MODEL, Rpc, prompt
from tests.vllm_events.ingest import read_line, stop
from tests.vllm_events.vllm_side import start, vllm_python
from tests.waiting import until

pytestmark = pytest.mark.skipif(vllm_python() is None, reason="needs KVSTORE_VLLM_PYTHON")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def eh(i: int) -> str:
    return hashlib.sha256(b"vllm-%d" % i).hexdigest()


async def test_vllm_publisher_feeds_the_engine_index(server_config) -> None:
    port, rport = free_port(), free_port()
    source = EngineSource(
        name="vllm-a",
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{rport}",
        model_id=MODEL,
    )
    server = Server(replace(server_config, engine_kv_events=(source,)))
    await server.start()
    rpc = Rpc(server.address)
    python = vllm_python()
    assert python is not None
    proc = start(python, "publish", f"tcp://*:{port}", f"tcp://*:{rport}")
    deadline = time.monotonic() + 120

    async def publish(*events: dict) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"events": list(events)}) + "\n")
        proc.stdin.flush()
        assert await read_line(proc, deadline) == "sent"

    try:
        ns = await rpc.register()
        chain = await rpc.store(seed=2, blocks=3)
        tokens = prompt(2, 3)
        index = server.node.engine_index
        assert index is not None
        state = index.engines["vllm-a"]
        assert await read_line(proc, deadline) == "ready"
        await publish(
            {"type": "BlockStored", "block_hashes": [eh(0), eh(1)], "parent": None,
             "token_ids": tokens[:8], "block_size": 4},
        )  # fmt: skip
        while state.last_seq is None:  # the SUB socket joins late: the replay fills in
            await publish()
            try:
                await until(lambda: state.last_seq is not None, within=0.3)
            except AssertionError:
                continue
        await until(lambda: len(index.blocks("vllm-a")) == 2, what="the first blocks")
        await publish(
            {"type": "BlockStored", "block_hashes": [eh(2)], "parent": eh(1),
             "token_ids": tokens[8:12], "block_size": 4},
        )  # fmt: skip
        await until(lambda: len(index.blocks("vllm-a")) == 3, what="the child block")
        assert index.longest(ns, "default", chain) == [EngineMatch("vllm-a", "GPU", 3)]

        await publish({"type": "BlockRemoved", "block_hashes": [eh(1)]})
        await until(lambda: len(index.blocks("vllm-a")) == 2, what="the removal")
        assert index.longest(ns, "default", chain) == [EngineMatch("vllm-a", "GPU", 1)]

        await publish({"type": "AllBlocksCleared"})
        await until(lambda: index.blocks("vllm-a") == [], what="the clear")
        assert state.counts.get("malformed", 0) == 0
    finally:
        stop(proc)
        await rpc.close()
        await server.stop(0.1)
