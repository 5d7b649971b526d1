"""A writer process that stalls between its lease check and its copy (issue 40, item 1).

Run by `tests.faults.test_late_writes` (and, in an engine's namespace, by
`tests.integrations.vllm.test_vllm_late_writer`): it reserves one block under a 1 s
lease, prints its slot and "ready", sleeps (the parent SIGSTOPs it there, as
a paused process, a swap storm or a stopped VM would stall it), then, once
continued, copies 0xEE over its slot as if its copy were still its own, and
exits without a commit. The SDK's own writes check the lease before each
copy; this one stands for a stall that lands after that check, inside the
copy, which no check on the writer's side can fence out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import grpc

from kvstore.client import Client
from kvstore.layout import KVLayout
from kvstore.types import SlotId
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from tests.client.blocks import LAYOUT

TENANT = "late"
LATE_BYTE = 0xEE


async def main(target: str, tokens: list[int], model: str, layout: KVLayout) -> None:
    async with Client(target, tenant=TENANT, lease_ttl=1.0, timeout=5.0) as kv:
        ns = await kv.register_namespace(model, layout, capacity_bytes=layout.block_bytes)
        lease_id, _ = await kv.lease.current()
        async with grpc.aio.insecure_channel(target) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            res = await stub.Reserve(
                pb.ReserveRequest(namespace_id=ns.id, lease_id=lease_id, tokens=tokens),
                metadata=(("x-kvstore-tenant", TENANT),),
                timeout=5,
            )
        [slot] = res.slots
        assert ns.mapping is not None
        target_view = ns.mapping.buffer(SlotId(slot))
        print(f"slot {slot}", flush=True)
        print("ready", flush=True)
        # Blocking on purpose: the whole process stalls here (the parent stops it).
        time.sleep(2.0)  # noqa: ASYNC251
        target_view[:] = bytes([LATE_BYTE]) * len(target_view)  # the late copy
        print("wrote", flush=True)
        sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--tokens", required=True)
    parser.add_argument("--model", default="late-model", help="a namespace's model id")
    parser.add_argument("--layout", default="", help="its layout, as KVLayout's fields in JSON")
    args = parser.parse_args()
    layout = KVLayout(**json.loads(args.layout)) if args.layout else LAYOUT
    asyncio.run(main(args.target, [int(t) for t in args.tokens.split(",")], args.model, layout))
