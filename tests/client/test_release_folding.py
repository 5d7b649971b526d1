"""Releases that queue behind one in flight go out as one `Release` call
(`kvstore.client.releases`), and each caller still gets its own answer."""

from __future__ import annotations

import asyncio

import numpy as np

from kvstore.client import Client

from .conftest import LAYOUT

HITS = 16  # 3 blocks each: the test pool holds 64


async def stored_chains(kv: Client, n: int) -> tuple[object, list[list[int]]]:
    ns = await kv.register_namespace("fold", LAYOUT)
    prompts = [[1000 * (i + 1) + t for t in range(3 * LAYOUT.block_size)] for i in range(n)]
    for tokens in prompts:
        blocks = np.zeros((3, LAYOUT.block_bytes), np.uint8)
        assert (await kv.store(ns, tokens, blocks)).committed == 3
    return ns, prompts


async def test_concurrent_releases_fold_into_fewer_calls(kv: Client) -> None:
    ns, prompts = await stored_chains(kv, HITS)
    hits = await asyncio.gather(*(kv.lookup(ns, tokens, pin=True) for tokens in prompts))
    hits += [await kv.lookup(ns, prompts[0][: 2 * LAYOUT.block_size], pin=True)]  # 2 blocks
    assert (await kv.stats()).namespaces[0].pinned == 3 * HITS
    calls = kv._releases.calls
    counts = await asyncio.gather(*(kv.release(hit) for hit in hits))
    assert counts == [3] * HITS + [2]  # each caller's own pins
    sent = kv._releases.calls - calls
    assert 2 <= sent < HITS  # the first goes alone; the rest queued behind it and folded
    assert (await kv.stats()).namespaces[0].pinned == 0
    assert not kv._releases._lanes  # nothing left waiting


async def test_a_release_cancelled_while_queued_is_never_sent(kv: Client) -> None:
    ns, prompts = await stored_chains(kv, 3)
    first, second, third = [await kv.lookup(ns, tokens, pin=True) for tokens in prompts]
    in_flight = asyncio.ensure_future(kv.release(first))
    await asyncio.sleep(0)  # its call is on the wire: the next ones queue
    queued = asyncio.ensure_future(kv.release(second))
    kept = asyncio.ensure_future(kv.release(third))
    await asyncio.sleep(0)
    queued.cancel()
    assert await in_flight == 3 and await kept == 3
    assert (await kv.stats()).namespaces[0].pinned == 3  # the cancelled hit's pins stay
    assert await kv.release(second) == 3  # and it can be released again
    assert (await kv.stats()).namespaces[0].pinned == 0
