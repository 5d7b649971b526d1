"""Wire-form benchmark: what a Lookup's messages cost, without gRPC and without the store.

One Lookup+pin of an N-block chain, both sides in this process: the client
builds and serialises the request, the node parses it and turns it into a
chain, builds and serialises the reply for N hit blocks, and the client
parses it into a `Hit`. Measured for the chain sent as ``packed_hashes``
(what the SDK sends) and as ``tokens`` (what a caller that does not hash
sends), in the one wire form of each (docs/api.md, "Wire forms"). The
node's hashing of tokens is left out. Prints one JSON object.

    python -m benchmarks.bench_wire [--blocks 512] [--block-size 16] [--iterations 300] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks._stats import median_call_us
from kvstore.client.handles import Namespace
from kvstore.client.replies import chain_fields, hit_from_proto
from kvstore.layout import KVLayout, NamespaceSpec
from kvstore.results import BlockRef, LookupResult, MissReason
from kvstore.types import BlockHash, LeaseId, NamespaceId, SlotId
from kvstore.v1 import kvstore_pb2 as pb
from service.api import chains, translate

MAX_BLOCKS = 16384


class _Descriptor:
    slots_per_arena = 4096
    block_bytes = 256 << 10


class _Pool:
    """The two things the reply builders read of a pool."""

    descriptor = _Descriptor()


def _lookup(mode: str, hashes: list[bytes], tokens: list[int], refs: Any) -> Callable[[], None]:
    pool: Any = _Pool()
    # What the core's lookup hands the servicer: arrays, no object per block.
    result = LookupResult(
        hashes=[r.hash for r in refs],
        slots=array("q", [r.slot for r in refs]),
        generations=array("Q", [r.generation for r in refs]),
        checksums=array("Q", [r.checksum for r in refs]),
        pinned=True,
        miss_reason=MissReason.NONE,
    )
    ns = Namespace(
        NamespaceSpec("m", KVLayout(4, 8, 128, 16, "float16")),
        NamespaceId("0" * 16),
        _Descriptor.block_bytes,
        MAX_BLOCKS,
        BlockHash(bytes(32)),
        False,
    )

    def run() -> None:
        fields = (
            chain_fields(tokens, None, None)
            if mode == "tokens"
            else chain_fields(None, hashes, None)
        )
        raw = pb.LookupRequest(namespace_id="x", pin=True, **fields).SerializeToString()
        request = pb.LookupRequest.FromString(raw)
        sent_tokens, _ = chains.request_chain(request, MAX_BLOCKS)
        if mode == "tokens":
            chains.token_array(sent_tokens)
        reply_fields = translate.lookup_reply(pool, result)
        if mode == "tokens":
            reply_fields["packed_chain"] = b"".join(hashes)
        reply = pb.LookupResponse(**reply_fields).SerializeToString()
        hit_from_proto(ns, pb.LookupResponse.FromString(reply), 0, LeaseId(0))

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_wire")
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="30 iterations (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.iterations = 30
    hashes = [os.urandom(32) for _ in range(args.blocks)]
    tokens = np.random.default_rng(1).integers(1, 128_000, args.blocks * args.block_size).tolist()
    refs = tuple(BlockRef(BlockHash(h), SlotId(i), 1) for i, h in enumerate(hashes))
    report: dict[str, Any] = {"blocks": args.blocks, "chain_tokens": len(tokens)}
    for mode in ("hashes", "tokens"):
        report[mode] = {"us": median_call_us(_lookup(mode, hashes, tokens, refs), args.iterations)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
