"""The client tests' layout and blocks: a tiny layout, a prompt of five and a bit blocks."""

from __future__ import annotations

import numpy as np

from kvstore.client import Client
from kvstore.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float16")
"""256-byte blocks, as in the service tests."""


TOKENS = list(range(1000, 1000 + 4 * 5 + 2))
"""Five full blocks and a partial one."""


def block(i: int) -> np.ndarray:
    return np.full(LAYOUT.block_shape, i + 0.5, np.float16)


async def stored_chains(kv: Client, n: int) -> tuple[object, list[list[int]]]:
    ns = await kv.register_namespace("fold", LAYOUT)
    prompts = [[1000 * (i + 1) + t for t in range(3 * LAYOUT.block_size)] for i in range(n)]
    for tokens in prompts:
        blocks = np.zeros((3, LAYOUT.block_bytes), np.uint8)
        assert (await kv.store(ns, tokens, blocks)).committed == 3
    return ns, prompts
