"""Releases queued behind one in flight ride on the next pinned Lookup of their
lane (``LookupRequest.release``): one call does both, each pin is dropped
exactly once, and a Lookup that fails hands its releases back to a Release."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.client.errors import DeadlineExceeded

from .test_release_folding import stored_chains


class Gate:
    """Holds the first ``Release`` call until opened; records every call's method."""

    def __init__(self, kv: Client, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = asyncio.Event()
        self.methods: list[str] = []
        self.lookups: list[Any] = []
        self._call = kv._rpc.call
        monkeypatch.setattr(kv._rpc, "call", self.call)

    async def call(self, method: str, request: Any, *args: Any, **kw: Any) -> Any:
        self.methods.append(method)
        if method == "Release" and not self.open.is_set():
            await self.open.wait()
        if method == "Lookup":
            self.lookups.append(request)
        return await self._call(method, request, *args, **kw)


async def queue_two(kv: Client, hits: list[Any]) -> tuple[asyncio.Future[int], ...]:
    """Release ``hits[0]`` (held in flight by the gate) and queue the next two."""
    first = asyncio.ensure_future(kv.release(hits[0]))
    await asyncio.sleep(0.01)  # its call waits at the gate: the next ones queue
    queued = tuple(asyncio.ensure_future(kv.release(hit)) for hit in hits[1:3])
    await asyncio.sleep(0.01)
    assert not any(f.done() for f in (first, *queued))
    return (first, *queued)


async def test_queued_releases_ride_on_a_pinned_lookup(
    kv: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, prompts = await stored_chains(kv, 4)
    hits = [await kv.lookup(ns, tokens, pin=True) for tokens in prompts[:3]]
    gate = Gate(kv, monkeypatch)
    first, second, third = await queue_two(kv, hits)
    looked = await kv.lookup(ns, prompts[3], pin=True)  # carries the two queued
    assert looked.hit_blocks == 3 and len(gate.lookups[-1].release.runs) == 2
    assert await second == 3 and await third == 3  # answered by the Lookup itself
    assert kv._releases.carried == 2
    gate.open.set()
    assert await first == 3
    assert gate.methods.count("Release") == 1  # only the first: the rest rode along
    # The lookup's own pins are all that is left.
    assert (await kv.stats()).namespaces[0].pinned == 3
    assert await kv.release(looked) == 3
    await kv._background.drain()
    assert not kv._releases._lanes


async def test_a_failed_carrying_lookup_sends_its_releases_again_once(
    kv: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node applied the carried releases but the Lookup's answer was lost: they
    go out again as a Release under the same ids, which drops nothing twice (another
    hit of the same lease pins the same blocks and keeps its pins)."""
    ns, prompts = await stored_chains(kv, 3)
    hits = [await kv.lookup(ns, tokens, pin=True) for tokens in prompts[:3]]
    others = [await kv.lookup(ns, tokens, pin=True) for tokens in prompts[1:3]]  # same blocks
    gate = Gate(kv, monkeypatch)
    first, second, third = await queue_two(kv, hits)
    lost: list[Any] = []

    async def answer_lost(method: str, request: Any, *args: Any, **kw: Any) -> Any:
        reply = await gate.call(method, request, *args, **kw)
        if method == "Lookup" and request.HasField("release") and not lost:
            lost.append(reply)
            raise DeadlineExceeded("Lookup: the answer was lost")
        return reply

    monkeypatch.setattr(kv._rpc, "call", answer_lost)
    with pytest.raises(DeadlineExceeded):
        await kv.lookup(ns, prompts[0], pin=True)
    assert lost and lost[0].released.released == 6  # the node applied them
    gate.open.set()
    assert await first == 3
    assert await second == 3 and await third == 3  # the first answers, repeated
    await kv._background.drain()
    # `others` still pin their 6 blocks (a second drop would have freed them), and
    # the lost lookup pinned prompts[0]'s 3 (the SDK never heard of those pins).
    assert (await kv.stats()).namespaces[0].pinned == 9
    assert [await kv.release(hit) for hit in others] == [3, 3]
    assert (await kv.stats()).namespaces[0].pinned == 3
    assert gate.methods.count("Release") >= 2  # the first, then the carried ones again


async def test_a_node_that_ignores_the_field_still_gets_the_releases(
    kv: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older node drops the unknown ``release`` field and answers no ``released``:
    the SDK sends the releases again as a Release, and they are applied once."""
    ns, prompts = await stored_chains(kv, 4)
    hits = [await kv.lookup(ns, tokens, pin=True) for tokens in prompts[:3]]
    gate = Gate(kv, monkeypatch)
    first, second, third = await queue_two(kv, hits)

    async def old_node(method: str, request: Any, *args: Any, **kw: Any) -> Any:
        if method == "Lookup" and request.HasField("release"):
            stripped = type(request)()
            stripped.CopyFrom(request)
            stripped.ClearField("release")
            request = stripped
        return await gate.call(method, request, *args, **kw)

    monkeypatch.setattr(kv._rpc, "call", old_node)
    looked = await kv.lookup(ns, prompts[3], pin=True)
    assert not second.done()  # nothing answered them: they wait for their Release
    assert kv._releases.carried == 0
    gate.open.set()
    assert await first == 3 and await second == 3 and await third == 3
    assert (await kv.stats()).namespaces[0].pinned == 3  # the lookup's own
    assert await kv.release(looked) == 3
