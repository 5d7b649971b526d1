"""A NIXL READ's states (`XferState`) and its waiter (`wait_read`), with a fake NIXL agent."""

from __future__ import annotations

import asyncio
import threading
import time
from itertools import product

import pytest

from service.cluster.nixl_agent import _MOVES, Transfer, XferState
from service.cluster.nixl_fetch import wait_read

ALLOWED = {
    (XferState.NEW, XferState.PROC),
    (XferState.NEW, XferState.DONE),
    (XferState.NEW, XferState.ERR),
    (XferState.PROC, XferState.DONE),
    (XferState.PROC, XferState.ERR),
}


class _Agent:
    """NIXL's ``transfer`` / ``check_xfer_state``: answers in order, the last one repeated."""

    def __init__(self, posted: str, checks: list[str], check_seconds: float = 0.0) -> None:
        self.posted = posted
        self.checks = checks
        self.check_seconds = check_seconds
        self.posts = 0
        self.busy = threading.Event()
        """Set while a call is inside the agent (the worker touches the transfer)."""

    def transfer(self, handle: object) -> str:
        self.posts += 1
        return self.posted

    def check_xfer_state(self, handle: object) -> str:
        self.busy.set()
        try:
            time.sleep(self.check_seconds)
            return self.checks.pop(0) if len(self.checks) > 1 else self.checks[0]
        finally:
            self.busy.clear()


@pytest.mark.parametrize(("start", "to"), list(product(XferState, XferState)))
def test_the_moves_table(start: XferState, to: XferState) -> None:
    if to is start or (start, to) in ALLOWED:
        assert start.advance(to) is to
    else:
        with pytest.raises(RuntimeError, match="bug"):
            start.advance(to)
    assert {(a, b) for a, moves in _MOVES.items() for b in moves} == ALLOWED


def test_nixl_strings_map_to_states() -> None:
    assert [XferState.of_nixl(s) for s in ("NEW", "PROC", "DONE", "ERR")] == list(XferState)
    assert XferState.of_nixl("SOMETHING ELSE") is XferState.ERR


def test_a_read_polled_to_its_end() -> None:
    agent = _Agent("PROC", ["PROC", "PROC", "DONE"])
    transfer = Transfer(agent, object())
    assert transfer.state() is XferState.NEW
    assert transfer.wait(time.monotonic() + 5, threading.Event()) is XferState.DONE
    assert transfer.state() is XferState.DONE
    assert agent.posts == 1


def test_a_poll_that_raises_is_a_failure() -> None:
    class Gone(_Agent):
        def check_xfer_state(self, handle: object) -> str:
            raise RuntimeError("nixlRemoteDisconnectError")

    transfer = Transfer(Gone("PROC", ["PROC"]), object())
    assert transfer.wait(time.monotonic() + 5, threading.Event()) is XferState.ERR


def test_stopped_before_posting_posts_nothing() -> None:
    agent = _Agent("PROC", ["PROC"])
    stop = threading.Event()
    stop.set()
    assert Transfer(agent, object()).wait(time.monotonic() + 5, stop) is XferState.NEW
    assert agent.posts == 0


async def test_a_read_past_its_deadline_is_in_flight() -> None:
    transfer = Transfer(_Agent("PROC", ["PROC"]), object())
    deadline = asyncio.get_running_loop().time() + 0.05
    assert await wait_read(transfer, deadline) is XferState.PROC


async def test_a_cancelled_wait_never_blocks_the_loop_and_stops_the_worker() -> None:
    # Each poll takes 0.2 s inside NIXL: the cancelled waiter must let the loop
    # run meanwhile, and return only once the worker is out of the agent.
    agent = _Agent("PROC", ["PROC"], check_seconds=0.2)
    transfer = Transfer(agent, object())
    loop = asyncio.get_running_loop()
    waiter = asyncio.create_task(wait_read(transfer, loop.time() + 30))
    assert await asyncio.to_thread(agent.busy.wait, 5)  # the worker is inside a poll
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.005)

    ticker = asyncio.create_task(tick())
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    ticker.cancel()
    assert not agent.busy.is_set()  # the worker left the agent before the waiter returned
    assert ticks >= 5  # the loop ran while the worker finished its poll
    assert transfer.state() is XferState.PROC  # in flight: the caller quarantines it
