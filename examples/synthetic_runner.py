"""A synthetic model runner for the docker-compose stack: store on one node, hit on another.

Stores a few synthetic prompts' KV blocks on the first node of
``KVSTORE_TARGETS`` (comma-separated ``host:port``), then asks the second
node for them with ``allow_remote``: the second node finds them in the
Redis directory, pulls them from the first over gRPC, and serves them. The
runner reads them back from the second node and checks every byte. Exits 0
on success, 1 with a message otherwise. No model, no GPU: bytes only.

Blocks are written and read in place, through the nodes' pool files: the
runner must see each node's pool directory (docker-compose mounts both pool
volumes into it). ``KVSTORE_MAP_POOL=0`` moves the bytes over gRPC instead,
for a runner on another host.

    KVSTORE_TARGETS=node-1:50051,node-2:50051 python examples/synthetic_runner.py
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import grpc

from kvstore.client import Client
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float16")
PROMPTS = 4
BLOCKS_PER_PROMPT = 8


def tokens_of(prompt: int) -> list[int]:
    return [(prompt * 7919 + i) % 32000 for i in range(BLOCKS_PER_PROMPT * LAYOUT.block_size)]


def block_of(prompt: int, index: int) -> bytes:
    return bytes((prompt * 13 + index * 5 + j) % 256 for j in range(LAYOUT.block_bytes))


async def wait_ready(target: str, deadline: float) -> None:
    """Until the node answers Ping (compose health checks normally did this already)."""
    while True:
        try:
            async with Client(target, map_pool=False, timeout=2) as client:
                await client.ping(b"x")
                return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def remote_lookup(target: str, namespace: str, prompt: int, deadline: float) -> int:
    """Lookup with allow_remote until the directory has caught up (it is eventually consistent)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        while True:
            resp = await stub.Lookup(
                pb.LookupRequest(
                    namespace_id=namespace, tokens=tokens_of(prompt), allow_remote=True
                ),
                timeout=10,
            )
            if resp.hit_blocks == BLOCKS_PER_PROMPT or time.monotonic() > deadline:
                return int(resp.hit_blocks)
            await asyncio.sleep(0.1)


async def main() -> int:
    targets = os.environ.get("KVSTORE_TARGETS", "127.0.0.1:50051,127.0.0.1:50052").split(",")
    if len(targets) < 2:
        print("synthetic_runner: KVSTORE_TARGETS needs two nodes", file=sys.stderr)
        return 1
    deadline = time.monotonic() + float(os.environ.get("RUNNER_TIMEOUT", "60"))
    for target in targets:
        await wait_ready(target, deadline)
    first, second = targets[0], targets[1]
    map_pool = os.environ.get("KVSTORE_MAP_POOL", "1") != "0"
    async with Client(first, map_pool=map_pool, client_name="synthetic-runner") as client:
        ns = await client.register_namespace("synthetic-model", LAYOUT)
        for prompt in range(PROMPTS):
            await client.store(
                ns,
                tokens_of(prompt),
                lambda i, p=prompt: block_of(p, i),  # type: ignore[misc]
            )
    async with Client(second, map_pool=map_pool, client_name="synthetic-runner") as client:
        ns = await client.register_namespace("synthetic-model", LAYOUT)
        for prompt in range(PROMPTS):
            hits = await remote_lookup(second, ns.id, prompt, deadline)
            if hits != BLOCKS_PER_PROMPT:
                print(f"synthetic_runner: prompt {prompt}: {hits} blocks via peer", file=sys.stderr)
                return 1
            hit = await client.lookup(ns, tokens_of(prompt), pin=True)
            if map_pool:  # in place, from node-2's pool file
                data = [bytes(buffer) for buffer in hit.buffers()]
            else:
                data = await client.read_blocks(hit)
            await client.release(hit)
            expected = [block_of(prompt, i) for i in range(BLOCKS_PER_PROMPT)]
            if data != expected:
                print(f"synthetic_runner: prompt {prompt}: bytes differ", file=sys.stderr)
                return 1
    how = "through the pools, mapped" if map_pool else "over gRPC"
    print(f"synthetic_runner: ok: {PROMPTS} prompts stored on {first}, served by {second} ({how})")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
