"""A runner that stalls past its lease's expiry never writes the slot it had reserved.

Issue #13: runner A reserves a slot and stalls in a long synchronous call
inside its store (its lease keeper cannot renew meanwhile); its lease
expires and the node takes the slot back; tenant B stores and commits a
block in it; A wakes up. A's copy must be refused (`LeaseExpired`) and B's
block keep its bytes. With ``write_quarantine_seconds = 0`` the node hands
A's slot straight to B, so only the SDK's lease check stands between A's
late copy and B's block; with the default quarantine both fences hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import types

import pytest

from kvstore.client import Client, SyncClient
from kvstore.client.replies import Reservation, reservation_from_proto
from kvstore.client.transfer import _copy_in
from kvstore.errors import FailedPrecondition, LeaseExpired
from kvstore.v1 import kvstore_pb2 as pb
from service.config import Config
from service.server import Server
from tests.client.blocks import LAYOUT
from tests.waiting import until

CAPACITY = 64
"""Blocks of the namespace's pool (the test server's default share)."""


@pytest.fixture(params=[0.0, 300.0], ids=["no-quarantine", "quarantine"])
def server_config(server_config: Config, request: pytest.FixtureRequest) -> Config:
    return dataclasses.replace(server_config, write_quarantine_seconds=request.param)


async def test_a_stalled_writer_is_refused_and_the_next_owner_keeps_its_bytes(
    kv_server: Server, server_config: Config
) -> None:
    runner_a = await asyncio.to_thread(
        SyncClient, kv_server.address, tenant="acme", lease_ttl=1.0, timeout=5.0
    )
    stalled, resume = threading.Event(), threading.Event()
    late_bytes = b"\xaa" * LAYOUT.block_bytes

    def stalling_block(i: int) -> bytes:
        stalled.set()
        resume.wait(30)  # a long synchronous call: A's loop (and its keeper) is stuck here
        return late_bytes

    try:
        ns_a = await asyncio.to_thread(runner_a.register_namespace, "m", LAYOUT)
        store_a = asyncio.ensure_future(
            asyncio.to_thread(runner_a.store, ns_a, list(range(4)), stalling_block)
        )
        assert await asyncio.to_thread(stalled.wait, 10)

        async with Client(kv_server.address, tenant="bob", timeout=5.0) as runner_b:

            async def a_expired() -> bool:
                return (await runner_b.stats()).leases_expired >= 1

            await until(a_expired, within=10.0, what="runner A's lease to expire on the node")
            ns_b = await runner_b.register_namespace("m", LAYOUT)
            tokens_b = list(range(10_000, 10_000 + 4 * CAPACITY))
            mine = b"\xbb" * LAYOUT.block_bytes
            stored = await runner_b.store(ns_b, tokens_b, lambda i: mine)
            no_quarantine = server_config.write_quarantine_seconds == 0
            # Without quarantine B gets every slot, A's included; with it, all but A's.
            assert stored.committed == (CAPACITY if no_quarantine else CAPACITY - 1)

            resume.set()  # A wakes up and goes on with its store
            with pytest.raises(FailedPrecondition) as refused:
                await store_a

            hit = await runner_b.lookup(ns_b, tokens_b, pin=True)
            assert hit.hit_blocks == stored.committed
            assert all(bytes(view) == mine for view in hit.buffers())
            await runner_b.release(hit)
            # Refused by the SDK before the copy, not by the node at Commit after it.
            assert isinstance(refused.value, LeaseExpired)
    finally:
        resume.set()
        await asyncio.to_thread(runner_a.close)


async def test_a_lease_whose_keeper_fell_behind_is_renewed_before_the_copy(kv: Client) -> None:
    ns = await kv.register_namespace("m", LAYOUT)
    await kv.store(ns, list(range(4)), [b"\x01" * LAYOUT.block_bytes])
    renewals = 0
    real_call = kv._rpc.call

    async def call(method: str, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal renewals
        renewals += method == "KeepAlive"
        return await real_call(method, request, *args, **kwargs)

    kv._rpc.call = call  # type: ignore[method-assign]
    # As if the event loop had been too busy to renew for almost a whole TTL:
    # the node still holds the lease, but too little of it is surely left to copy.
    kv._session.clock = lambda: time.monotonic() + kv.lease_ttl - 0.5  # type: ignore[method-assign]
    result = await kv.store(ns, list(range(100, 108)), [b"\x02" * LAYOUT.block_bytes] * 2)
    assert result.committed == 2 and renewals == 1


class _FakeMapping:
    """A host pool of a few slots that counts synchronisations."""

    closed = False

    def __init__(self, slots: int, size: int) -> None:
        self.memory = bytearray(slots * size)
        self.size = size
        self.synchronized = 0
        self.descriptor = types.SimpleNamespace(
            kind="host",
            locate=lambda slot: (0, slot * size),
            slots_per_arena=slots,
            block_bytes=size,
        )

    def buffer(self, slot: int) -> memoryview:
        return memoryview(self.memory)[slot * self.size : (slot + 1) * self.size]

    def synchronize(self) -> None:
        self.synchronized += 1


def _entries(n: int, size: int) -> Reservation:
    """A Reserve reply: block i RESERVED in slot i of arena 0 (of ``n`` slots)."""
    return reservation_from_proto(
        pb.ReserveResponse(
            hashes=b"".join(bytes([i]) * 32 for i in range(n)),
            statuses=[pb.RESERVE_STATUS_RESERVED] * n,
            slots=range(n),
            generations=[1] * n,
            slots_per_arena=n,
            block_bytes=size,
        )
    )


def test_the_lease_is_checked_between_blocks_and_queued_copies_finish_before_the_abort() -> None:
    size = 8
    mapping = _FakeMapping(3, size)
    ns = types.SimpleNamespace(mapping=mapping, layout=LAYOUT)
    checks = 0

    def lease_alive() -> None:
        nonlocal checks
        checks += 1
        if checks == 2:  # the process stalled after the first block; the lease lapsed
            raise LeaseExpired("lapsed")

    with pytest.raises(LeaseExpired):
        _copy_in(ns, _entries(3, size), [b"\x01" * size] * 3, lease_alive)  # type: ignore[arg-type]
    assert bytes(mapping.memory) == b"\x01" * size + bytes(2 * size)  # blocks 2 and 3 untouched
    assert mapping.synchronized == 1  # before the caller aborts the reservation
