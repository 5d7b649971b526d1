"""vLLM KV-event benchmark: what publishing and ingesting cost the node's event loop.

- **publish**: the loop-side cost of one STORED event of N blocks handed to
  `KvEventPublisher.publish` (conversion and a queue put; msgpack and ZMQ run
  on the sender thread), against the baseline of what `Node.publish_events`
  already did per event: the ``WatchEvents`` conversion (`translate.event`).
- **ingest**: one BlockStored of N blocks re-keyed by `EngineIndex.ingest`
  (decode included), against the baseline of hashing the same tokens alone
  (`kvstore.hashing.hash_blocks`, what a Lookup with tokens costs).

Needs the ``events`` extra (pyzmq, msgpack). Prints one JSON object.

    python -m benchmarks.bench_kv_events [--blocks 64] [--block-size 16] [--iterations N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import msgpack

from benchmarks._stats import median_call_us
from kvstore.events import CacheEvent, EventKind
from kvstore.hashing import HashScheme, hash_blocks
from kvstore.types import BlockHash, NamespaceId, TenantId
from service.api import translate
from service.config.engines import EngineSource
from service.vllm_events.engine_index import ChainStart, EngineIndex
from service.vllm_events.publisher import KvEventPublisher
from service.vllm_events.wire import decode_batch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_kv_events")
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="30 iterations (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.iterations = 30
    n, size = args.blocks, args.block_size
    hashes = tuple(BlockHash(os.urandom(32)) for _ in range(n))
    event = CacheEvent(EventKind.STORED, NamespaceId("ns"), TenantId("t"), hashes, None, 1.0)
    report: dict[str, Any] = {"blocks": n, "block_size": size}

    publisher = KvEventPublisher(
        "inproc://bench-kv-events",
        medium="CPU_kvstore",
        buffer_batches=args.iterations * 4 + 8,
        block_size_of=lambda _: size,
        wall=time.time,
    )
    try:
        report["publish_us"] = median_call_us(lambda: publisher.publish([event]), args.iterations)
    finally:
        publisher.close()
    report["publish_baseline_watch_convert_us"] = median_call_us(
        lambda: translate.event(event, "node", lambda t: t), args.iterations
    )

    tokens = list(range(1, n * size + 1))
    root = BlockHash(bytes(32))
    start = ChainStart(NamespaceId("ns"), TenantId("t"), root, size, HashScheme.KVSTORE_SHA256)
    source = EngineSource(name="e", endpoint="tcp://unused:1", model_id="m")
    index = EngineIndex([source], lambda _m, _t: start, max_blocks=1 << 30)
    engine_hashes = [os.urandom(32) for _ in range(n)]
    payload = msgpack.packb(
        [1.0, [{"type": "BlockStored", "block_hashes": engine_hashes, "parent_block_hash": None,
                "token_ids": tokens, "block_size": size, "lora_id": None, "medium": "GPU",
                "lora_name": None}], 0]
    )  # fmt: skip

    def ingest() -> None:
        index.ingest("e", decode_batch(payload))
        index.clear("e")

    report["ingest_us"] = median_call_us(ingest, args.iterations)
    report["ingest_baseline_hash_tokens_us"] = median_call_us(
        lambda: hash_blocks(root, tokens, size), args.iterations
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
