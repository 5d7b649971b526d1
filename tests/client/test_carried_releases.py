"""Releases queued behind one in flight ride on the next pinned Lookup of their
lane (``LookupRequest.release``): one call does both, each pin is dropped
exactly once, and a Lookup that fails hands its releases back to a Release."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.client.errors import DeadlineExceeded
from kvstore.client.methods import Unary
from tests.client.blocks import stored_chains
from tests.waiting import until


class Gate:
    """Holds the first ``Release`` call until opened; records every call's method."""

    def __init__(self, kv: Client, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = asyncio.Event()
        self.methods: list[str] = []
        self.lookups: list[Any] = []
        self._call = kv._rpc.call
        monkeypatch.setattr(kv._rpc, "call", self.call)

    async def call(self, method: Unary, request: Any, *args: Any, **kw: Any) -> Any:
        self.methods.append(method.name)
        if method.name == "Release" and not self.open.is_set():
            await self.open.wait()
        if method.name == "Lookup":
            self.lookups.append(request)
        return await self._call(method, request, *args, **kw)


def queued(kv: Client) -> int:
    """Releases waiting in the client's lanes."""
    return sum(len(lane.queued) for lane in kv._releases._lanes.values())


async def queue_two(kv: Client, gate: Gate, hits: list[Any]) -> tuple[asyncio.Future[int], ...]:
    """Release ``hits[0]`` (held in flight by the gate) and queue the next two."""
    first = asyncio.ensure_future(kv.release(hits[0]))
    # At the gate: the next ones queue.
    await until(lambda: "Release" in gate.methods, interval=0.001)
    waiting = tuple(asyncio.ensure_future(kv.release(hit)) for hit in hits[1:3])
    await until(lambda: queued(kv) == 2, interval=0.001)
    assert not any(f.done() for f in (first, *waiting))
    return (first, *waiting)


async def test_queued_releases_ride_on_a_pinned_lookup(
    kv: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, prompts = await stored_chains(kv, 4)
    hits = [await kv.lookup(ns, tokens, pin=True) for tokens in prompts[:3]]
    gate = Gate(kv, monkeypatch)
    first, second, third = await queue_two(kv, gate, hits)
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
    first, second, third = await queue_two(kv, gate, hits)
    lost: list[Any] = []

    async def answer_lost(method: Unary, request: Any, *args: Any, **kw: Any) -> Any:
        reply = await gate.call(method, request, *args, **kw)
        if method.name == "Lookup" and request.HasField("release") and not lost:
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
    first, second, third = await queue_two(kv, gate, hits)

    async def old_node(method: Unary, request: Any, *args: Any, **kw: Any) -> Any:
        if method.name == "Lookup" and request.HasField("release"):
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


async def test_a_release_behind_a_pinned_lookup_waits_for_it_then_goes_alone(
    kv: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pinned Lookup in flight holds the lane: a release queues behind it, rides on
    the next pinned Lookup if one comes, else goes out as a Release once it ends."""
    ns, prompts = await stored_chains(kv, 3)
    first = await kv.lookup(ns, prompts[0], pin=True)
    second = await kv.lookup(ns, prompts[1], pin=True)
    gate = asyncio.Event()
    methods: list[str] = []
    call = kv._rpc.call

    async def held_lookup(method: Unary, request: Any, *args: Any, **kw: Any) -> Any:
        methods.append(method.name)
        if method.name == "Lookup" and not gate.is_set():
            await gate.wait()
        return await call(method, request, *args, **kw)

    monkeypatch.setattr(kv._rpc, "call", held_lookup)
    looking = asyncio.ensure_future(kv.lookup(ns, prompts[2], pin=True))
    # At the gate: a pinned Lookup is in flight.
    await until(lambda: "Lookup" in methods, interval=0.001)
    released = asyncio.ensure_future(kv.release(first))
    await until(lambda: queued(kv) == 1, interval=0.001)
    assert "Release" not in methods and not released.done()  # queued behind the lookup
    gate.set()
    hit = await looking
    assert await released == 3  # sent alone once the lookup ended
    assert methods.count("Release") == 1 and kv._releases.carried == 0
    # Behind a held lookup again, a second pinned Lookup carries the queued release.
    gate.clear()
    lookups = methods.count("Lookup")
    looking = asyncio.ensure_future(kv.lookup(ns, prompts[2], pin=True))
    await until(lambda: methods.count("Lookup") == lookups + 1, interval=0.001)
    released = asyncio.ensure_future(kv.release(second))
    await until(lambda: queued(kv) == 1, interval=0.001)
    carrying = asyncio.ensure_future(kv.lookup(ns, prompts[0], pin=True))
    # Sent (held too), the release inside.
    await until(lambda: kv._releases.carried == 1, interval=0.001)
    assert queued(kv) == 0
    gate.set()
    carrier = await carrying
    assert await released == 3 and kv._releases.carried == 1
    assert methods.count("Release") == 1
    for h in (hit, await looking, carrier):
        assert await kv.release(h) == 3
    await kv._background.drain()
    assert (await kv.stats()).namespaces[0].pinned == 0
    assert not kv._releases._lanes


async def test_a_remote_lookup_in_flight_does_not_hold_releases_back(
    kv: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pinned Lookup with ``allow_remote`` may wait seconds on a peer: a release
    that comes meanwhile goes out at once instead of queueing behind it."""
    ns, prompts = await stored_chains(kv, 2)
    first = await kv.lookup(ns, prompts[0], pin=True)
    gate = asyncio.Event()
    methods: list[str] = []
    call = kv._rpc.call

    async def held_lookup(method: Unary, request: Any, *args: Any, **kw: Any) -> Any:
        methods.append(method.name)
        if method.name == "Lookup" and not gate.is_set():
            await gate.wait()
        return await call(method, request, *args, **kw)

    monkeypatch.setattr(kv._rpc, "call", held_lookup)
    looking = asyncio.ensure_future(kv.lookup(ns, prompts[1], pin=True, allow_remote=True))
    await until(lambda: "Lookup" in methods, interval=0.001)
    assert await kv.release(first) == 3  # answered while the remote lookup is held
    assert methods.count("Release") == 1
    gate.set()
    assert await kv.release(await looking) == 3
    await kv._background.drain()
    assert not kv._releases._lanes


class _StubRpc:
    """Answers each Release with one pin per hash, after ``gate`` opens."""

    timeout = 5.0

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def call(self, method: Unary, request: Any, *args: Any, **kw: Any) -> Any:
        from kvstore.v1 import kvstore_pb2 as pb

        await self.gate.wait()
        return pb.ReleaseResponse(released=len(request.packed_hashes) // 32)


async def test_a_remote_lookup_that_outlives_its_lane_still_settles_its_releases() -> None:
    """An ``allow_remote`` Lookup carries its lane's queue without holding the lane: the
    lane may go idle and be dropped before the Lookup ends. Its carried releases must
    still settle (they were lost, and their pins held for the lease's life, when the end
    of the Lookup raised KeyError on the dropped lane)."""
    from kvstore.client.background import Background
    from kvstore.client.releases import Releases
    from kvstore.v1 import kvstore_pb2 as pb

    rpc = _StubRpc()
    releases = Releases(rpc, Background())  # type: ignore[arg-type]
    first = releases.submit("ns", 7, b"a" * 32, 1)  # sent at once, held by the gate
    second = releases.submit("ns", 7, b"b" * 64, 2)  # queued behind it
    lookup = pb.LookupRequest(namespace_id="ns", lease_id=7, pin=True, allow_remote=True)
    batch = releases.carry(lookup)
    assert [w.release_id for w in batch] == [2]
    rpc.gate.set()
    assert await first == 1  # the lane is idle now, and dropped
    failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    failed.set_exception(DeadlineExceeded("the lookup timed out"))
    releases.settle_carried(lookup, batch, failed)
    assert await asyncio.wait_for(second, 5) == 2  # sent again as a Release
