"""LeaseKeeper without a server: lazy open, renewal, replacement of a lost lease."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvstore.client import LeaseGrant, LeaseKeeper
from kvstore.client.errors import ServerError
from kvstore.errors import NotFound
from kvstore.types import LeaseId
from tests.waiting import until


class FakeNode:
    def __init__(self) -> None:
        self.next_id = 1
        self.live: set[int] = set()
        self.renewals = 0
        self.closed: list[int] = []

    async def open(self) -> LeaseGrant:
        lease = LeaseId(self.next_id)
        self.next_id += 1
        self.live.add(lease)
        return LeaseGrant(lease, ttl=0.06)

    async def renew(self, lease: LeaseId) -> float:
        if lease not in self.live:
            raise NotFound(f"no lease {lease}")
        self.renewals += 1
        return 0.06

    async def close(self, lease: LeaseId) -> None:
        self.live.discard(lease)
        self.closed.append(lease)


async def test_open_once_renew_and_replace() -> None:
    node = FakeNode()
    keeper = LeaseKeeper(node.open, node.renew, node.close)
    assert keeper.lease_id is None
    first = await asyncio.gather(keeper.current(), keeper.current())
    assert list(first) == [(1, 0), (1, 0)]  # concurrent callers share one open
    await until(lambda: node.renewals >= 2, within=5.0, what="two renewals")  # every 0.02 s
    assert node.renewals >= 2
    node.live.clear()  # the node restarted
    await until(lambda: keeper.lost == 1, within=5.0, what="the lost lease to be noticed")
    assert keeper.lost == 1 and keeper.generation == 1
    assert await keeper.current() == (2, 1)
    await keeper.close()
    await keeper.close()
    assert node.closed == [2]


async def test_a_renewal_the_stopping_node_cancels_is_retried_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A KeepAlive in flight while the node stops ends CANCELLED: retried like an
    unreachable node, with no ERROR and no traceback in the runner's log."""
    node = FakeNode()
    cancelled = 2

    async def renew(lease: LeaseId) -> float:
        nonlocal cancelled
        if cancelled:
            cancelled -= 1
            raise ServerError("CANCELLED: Cancelled", grpc.StatusCode.CANCELLED)
        return await node.renew(lease)

    keeper = LeaseKeeper(node.open, renew, node.close)
    await keeper.current()
    await until(lambda: node.renewals >= 1, within=5.0, what="a renewal after the cancelled ones")
    await keeper.close()
    assert cancelled == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
