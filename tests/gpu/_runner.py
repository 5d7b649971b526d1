"""Runner processes of the GPU tests: ``python -m tests.gpu._runner MODE ADDRESS [SEED]``.

Modes print one JSON line on stdout:

* ``store``: store 8 blocks generated from SEED on the GPU, through the IPC mapping;
* ``read``: look the same chain up, compare the mapped tensors byte-exact;
* ``hang``: attach, pin a hit, reserve and half-write blocks, then wait to be killed;
* ``descriptor``: print the AttachPool descriptor (handles in hex) and exit;
* ``hold``: store, pin and view the blocks, print the namespace id, wait for a
  line on stdin (the test drops the namespace and stores into a new pool
  meanwhile), then compare the views again: a node that freed the arena while
  this process still had it open could hand its memory to the new pool.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import torch

from kvstore.client import Client
from kvstore.layout import KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
BLOCKS = 8


def chain(seed: int) -> tuple[list[int], list[torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens = [(seed * 7919 + i) % 32000 for i in range(BLOCKS * LAYOUT.block_size)]
    blocks = [
        torch.randn(LAYOUT.block_shape, generator=gen, device="cuda").to(torch.bfloat16)
        for _ in range(BLOCKS)
    ]
    return tokens, blocks


async def main(mode: str, address: str, seed: int) -> dict[str, object]:
    torch.cuda.init()
    async with Client(address, tenant="gpu-test", timeout=30.0, lease_ttl=2.0) as kv:
        ns = await kv.register_namespace("gpu-test-model", LAYOUT)
        tokens, blocks = chain(seed)
        if mode == "store":
            result = await kv.store(ns, tokens, blocks)
            return {"committed": result.committed, "hit": result.hit}
        if mode == "read":
            hit = await kv.lookup(ns, tokens, pin=True)
            views = hit.torch_views()
            exact = all(
                torch.equal(v.view(torch.uint16), b.view(torch.uint16))
                for v, b in zip(views, blocks, strict=True)
            )
            device = str(views[0].device) if views else ""
            del views
            await kv.release(hit)
            return {"hit_blocks": hit.hit_blocks, "exact": exact, "device": device}
        if mode == "hang":
            hit = await kv.lookup(ns, tokens, pin=True)
            _ = [v.float().sum().item() for v in hit.torch_views()]  # mapping in use
            other_tokens, other_blocks = chain(seed + 1)

            def block(i: int) -> torch.Tensor:
                if i == 1:  # block 0 is written into its reserved slot; then we stall
                    print(json.dumps({"pinned": hit.hit_blocks, "writing": True}), flush=True)
                    time.sleep(3600)
                return other_blocks[i]

            await kv.store(ns, other_tokens, block)
        if mode == "hold":
            await kv.store(ns, tokens, blocks)
            hit = await kv.lookup(ns, tokens, pin=True)
            views = hit.torch_views()
            print(json.dumps({"namespace_id": ns.id, "hit_blocks": hit.hit_blocks}), flush=True)
            await asyncio.to_thread(sys.stdin.readline)
            torch.cuda.synchronize()
            exact = all(
                torch.equal(v.view(torch.uint16), b.view(torch.uint16))
                for v, b in zip(views, blocks, strict=True)
            )
            del views
            return {"exact_after_drop": exact}
        if mode == "descriptor":
            mapping = ns.mapping
            assert mapping is not None
            d = mapping.descriptor
            return {
                "epoch": d.epoch,
                "device": d.device,
                "handles": [a.cuda_ipc_handle.hex() for a in d.arenas],
            }
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    out = asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1))
    print(json.dumps(out), flush=True)
