"""Ingesting an engine's KV events (hand-built publisher): chains, replay, restarts, bad input.

The engine's blocks are keyed by the engine's own hashes; the node must
re-key them into its own chain hashes of the model's namespace, so the
index matches the chain a Lookup with the same tokens computes.
"""

from __future__ import annotations

import hashlib

import msgpack
from prometheus_client import generate_latest

from service.vllm_events.engine_index import EngineMatch
from tests.redis.rpc import Rpc, prompt
from tests.vllm_events.fake_engine import FakeEngine, batch, removed, stored
from tests.vllm_events.ingest import join, start_node
from tests.waiting import until


def eh(i: int) -> bytes:
    """An engine's hash of block ``i`` (opaque to the node)."""
    return hashlib.sha256(b"engine-%d" % i).digest()


async def test_chains_replay_gaps_restart_and_bad_input(server_config) -> None:
    engine = FakeEngine()
    server = await start_node(server_config, engine)
    rpc = Rpc(server.address)
    try:
        ns = await rpc.register()
        chain = await rpc.store(seed=1, blocks=4)  # the node's own keys of these tokens
        tokens = prompt(1, 4)
        index = server.node.engine_index
        assert index is not None
        state = index.engines["fake-0"]

        # Batch 0 is never published: the node must get it from the replay socket.
        engine.keep(0, batch([stored([eh(0), eh(1)], None, tokens[:8])]))
        seq = await join(engine, state, 1)
        await until(lambda: index.longest(ns, "default", chain) != [], what="replayed batch 0")
        assert index.longest(ns, "default", chain) == [EngineMatch("fake-0", "GPU", 2)]
        assert state.counts["replayed"] >= 1

        # A gap: batch `seq` is kept only, `seq + 1` (array encoding, map batch) is sent.
        engine.keep(seq, batch([stored([eh(2)], eh(1), tokens[8:12])]))
        engine.send(
            seq + 1, batch([stored([eh(3)], eh(2), tokens[12:16], array=True)], as_map=True)
        )
        seq += 2
        await until(lambda: state.last_seq == seq - 1, what="the gap replayed")
        assert index.longest(ns, "default", chain) == [EngineMatch("fake-0", "GPU", 4)]
        assert sorted(h for h, _ in index.blocks("fake-0")) == sorted(chain)

        # A block whose parent the node never saw: skipped and counted.
        engine.send(seq, batch([stored([eh(9)], eh(8), tokens[:4])]))
        seq += 1
        await until(lambda: state.last_seq == seq - 1)
        assert state.counts["unknown_parent"] == 1
        assert len(index.blocks("fake-0")) == 4

        # Bad input: counted, skipped; the next good batch is ingested.
        engine.send(seq, b"\xc1 not msgpack")
        engine.send(seq + 1, msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]))
        engine.send(seq + 2, msgpack.packb({"no": "batch"}))
        engine.send_raw([b"", b"short"])
        engine.send(seq + 3, batch([{"type": "SomethingNew"}, removed([eh(3)])]))
        seq += 4
        await until(lambda: state.last_seq == seq - 1, what="the batch after the bad ones")
        assert state.counts["malformed"] == 4
        scrape = generate_latest(server.node.metrics.registry).decode()
        assert 'kvstore_engine_events_total{engine="fake-0",kind="malformed"} 4.0' in scrape
        assert 'kvstore_engine_blocks{engine="fake-0",medium="GPU"} 3.0' in scrape
        assert index.longest(ns, "default", chain) == [EngineMatch("fake-0", "GPU", 3)]

        # A restart (sequence numbers start over): the engine's blocks are dropped.
        engine.send(0, batch([stored([eh(0)], None, tokens[:4])]))
        await until(lambda: state.counts.get("restarts") == 1, what="the restart")
        await until(lambda: state.last_seq == 0)
        assert index.longest(ns, "default", chain) == [EngineMatch("fake-0", "GPU", 1)]

        # AllBlocksCleared drops everything.
        engine.send(1, batch([{"type": "AllBlocksCleared"}]))
        await until(lambda: state.last_seq == 1)
        assert index.longest(ns, "default", chain) == []
        assert index.blocks("fake-0") == []
    finally:
        await rpc.close()
        await server.stop(0.1)
        engine.close()


async def test_blocks_of_an_unregistered_model_are_counted(server_config) -> None:
    engine = FakeEngine()
    server = await start_node(server_config, engine)
    try:
        index = server.node.engine_index
        assert index is not None
        state = index.engines["fake-0"]
        engine.keep(0, batch([stored([eh(0)], None, list(range(4)))]))
        await join(engine, state, 1)
        await until(lambda: state.counts.get("no_namespace") == 1, what="the skip")
        assert index.blocks("fake-0") == []
    finally:
        await server.stop(0.1)
        engine.close()
