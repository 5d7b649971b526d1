"""Releases that queue behind one in flight go out as one `Release` call
(`kvstore.client.releases`), and each caller still gets its own answer."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.client import Client, releases
from kvstore.client.errors import DeadlineExceeded, ServerUnavailable
from kvstore.client.methods import Unary
from kvstore.client.retry import Backoff
from kvstore.errors import FailedPrecondition
from tests.client.blocks import LAYOUT, stored_chains
from tests.waiting import until

HITS = 16  # 3 blocks each: the test pool holds 64


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


async def test_a_release_cancelled_while_queued_is_still_sent(kv: Client) -> None:
    """Cancelling a release only stops the waiting: queued behind another, it still
    goes out with the next call (its pins once stayed until the lease ended)."""
    ns, prompts = await stored_chains(kv, 3)
    first, second, third = [await kv.lookup(ns, tokens, pin=True) for tokens in prompts]
    in_flight = asyncio.ensure_future(kv.release(first))
    await asyncio.sleep(0)  # its call is on the wire: the next ones queue
    queued = asyncio.ensure_future(kv.release(second))
    kept = asyncio.ensure_future(kv.release(third))
    await asyncio.sleep(0)
    queued.cancel()
    assert await in_flight == 3 and await kept == 3
    with pytest.raises(asyncio.CancelledError):
        await queued
    await kv._background.drain()
    assert (await kv.stats()).namespaces[0].pinned == 0  # the cancelled hit's pins too
    assert second.released  # no views of it from the moment release was called
    assert await kv.release(second) == 3  # a repeat drops nothing more (same id)
    assert not kv._releases._lanes


async def test_a_release_cancelled_in_flight_still_drops_the_pins(kv: Client) -> None:
    ns, prompts = await stored_chains(kv, 1)
    hit = await kv.lookup(ns, prompts[0], pin=True)
    call = asyncio.ensure_future(kv.release(hit))
    await asyncio.sleep(0)  # handed over: the call is in flight
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await kv._background.drain()
    assert (await kv.stats()).namespaces[0].pinned == 0


def lose_first_release_answer(kv: Client, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The first Release reaches the node but its answer is lost (a timeout to the caller);
    the list gets the lost answer."""
    call = kv._rpc.call
    lost: list[object] = []

    async def answer_lost(method: Unary, request: object, *args: object, **kw: object) -> object:
        reply = await call(method, request, *args, **kw)
        if method.name == "Release" and not lost:
            lost.append(reply)
            raise DeadlineExceeded("Release: the answer was lost")
        return reply

    monkeypatch.setattr(kv._rpc, "call", answer_lost)
    return lost


async def test_a_retried_release_never_drops_another_hits_pin(
    kv: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two hits of one lease pin the same blocks (pins are counts per lease). The
    first hit's Release reaches the node but its answer is lost (a timeout); the
    caller releases it again: the second hit's pins must stay."""
    ns, prompts = await stored_chains(kv, 1)
    mine = await kv.lookup(ns, prompts[0], pin=True)
    other = await kv.lookup(ns, prompts[0], pin=True)  # the same 3 blocks, pinned again
    lost = lose_first_release_answer(kv, monkeypatch)
    with pytest.raises(DeadlineExceeded):
        await kv.release(mine)
    assert lost and (await kv.stats()).namespaces[0].pinned == 3  # applied: one pin each left
    assert await kv.release(mine) == 3  # the retry: the node's first answer, nothing dropped
    assert await kv.release(mine) == 0  # answered: nothing is sent any more
    assert (await kv.stats()).namespaces[0].pinned == 3  # `other` still holds its pins
    with pytest.raises(FailedPrecondition):
        mine.numpy_views()  # released, whatever the outcome was
    assert len(other.numpy_views()) == 3
    assert await kv.release(other) == 3
    assert (await kv.stats()).namespaces[0].pinned == 0


async def test_a_release_retried_after_5000_others_never_drops_another_hits_pin(
    kv: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#31 item 3: the node remembered a lease's last 4,096 release ids, so a
    retry that came after more releases than that (a lost answer, a busy
    engine) was applied again and dropped the pins of another hit of the same
    lease. Each pinned lookup now names its pins (``release_id``): a retry,
    however late, drops nothing."""
    ns, prompts = await stored_chains(kv, 2)
    mine = await kv.lookup(ns, prompts[0], pin=True)
    other = await kv.lookup(ns, prompts[0], pin=True)  # the same 3 blocks, pinned again
    assert mine.release_id and other.release_id and mine.release_id != other.release_id
    lost = lose_first_release_answer(kv, monkeypatch)
    with pytest.raises(DeadlineExceeded):
        await kv.release(mine)
    assert lost and (await kv.stats()).namespaces[0].pinned == 3
    released = 0
    for _ in range(20):  # 5,000 other hits, looked up and released in waves
        hits = await asyncio.gather(*(kv.lookup(ns, prompts[1], pin=True) for _ in range(250)))
        released += sum(await asyncio.gather(*(kv.release(h) for h in hits)))
    assert released == 5000 * 3
    assert await kv.release(mine) == 0  # the late retry: nothing dropped
    stats = (await kv.stats()).namespaces[0]
    assert stats.pinned == 3  # `other` still holds its pins
    assert len(other.numpy_views()) == 3
    assert await kv.release(other) == 3
    assert (await kv.stats()).namespaces[0].pinned == 0


def fail_releases(kv: Client, monkeypatch: pytest.MonkeyPatch, times: int) -> list[str]:
    """The next ``times`` Release calls never reach the node (it is unavailable); the
    list gets a line per Release call made."""
    call = kv._rpc.call
    calls: list[str] = []

    async def unavailable(method: Unary, request: object, *args: object, **kw: object) -> object:
        if method.name == "Release":
            calls.append("failed" if len(calls) < times else "sent")
            if calls[-1] == "failed":
                raise ServerUnavailable("Release: the node did not answer")
        return await call(method, request, *args, **kw)

    monkeypatch.setattr(kv._rpc, "call", unavailable)
    monkeypatch.setattr(releases, "RESEND_BACKOFF", Backoff(base=0.01, cap=0.02))
    return calls


async def test_a_release_the_node_did_not_answer_is_sent_again_until_it_does(
    kv: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that hangs or a host that stalls loses a Release: its caller gets the
    error, and the SDK sends it again by itself (the lease lives on, so a release
    given up would pin its blocks for the runner's life)."""
    ns, prompts = await stored_chains(kv, 1)
    hit = await kv.lookup(ns, prompts[0], pin=True)
    calls = fail_releases(kv, monkeypatch, times=3)
    with pytest.raises(ServerUnavailable):
        await kv.release(hit)
    await until(lambda: kv._releases._resends, ok=lambda tasks: not tasks)
    assert calls == ["failed", "failed", "failed", "sent"]
    assert (await kv.stats()).namespaces[0].pinned == 0
    assert not kv._releases._lanes


async def test_closing_the_client_stops_sending_releases_again(
    kv: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that never answers: closing the client stops the re-sends at once (its
    lease's end drops the pins) instead of waiting on them."""
    ns, prompts = await stored_chains(kv, 1)
    hit = await kv.lookup(ns, prompts[0], pin=True)
    calls = fail_releases(kv, monkeypatch, times=10**6)
    with pytest.raises(ServerUnavailable):
        await kv.release(hit)
    await until(lambda: len(calls), ok=lambda n: n >= 3)  # sent again, and again
    await asyncio.wait_for(kv.close(), timeout=10)
    await asyncio.sleep(0)
    assert not kv._releases._resends


async def test_a_cancelled_pinned_lookups_release_is_sent_again_until_the_node_answers(
    kv: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40, item 5: a pinned Lookup cancelled in flight is released once the node
    answers it; that release used to be one bare call, so a node unavailable at that
    moment left the pins for the lease's life (the runner's). It now takes the one
    release route: retried, and sent again until the node answers."""
    ns, prompts = await stored_chains(kv, 1)
    calls = fail_releases(kv, monkeypatch, times=3)
    held = asyncio.Event()
    unavailable = kv._rpc.call

    async def slow_lookup(method: Unary, request: object, *args: object, **kw: object) -> object:
        if method.name == "Lookup":
            held.set()
            await asyncio.sleep(0.05)  # the caller gives up meanwhile; the node pins
        return await unavailable(method, request, *args, **kw)

    monkeypatch.setattr(kv._rpc, "call", slow_lookup)
    looking = asyncio.ensure_future(kv.lookup(ns, prompts[0], pin=True))
    await held.wait()
    looking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await looking
    await until(lambda: calls, ok=lambda c: c[-1:] == ["sent"])
    await until(lambda: kv._releases._resends, ok=lambda tasks: not tasks)
    assert calls == ["failed", "failed", "failed", "sent"]
    assert (await kv.stats()).namespaces[0].pinned == 0
