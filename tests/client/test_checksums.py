"""The SDK's checksums: sent with every store, answered with every hit, checked on
a load when asked (`Hit.check_bytes`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from kvstore.checksum import block_checksum, unpack_checksums
from kvstore.client import Client
from kvstore.client.errors import BlocksMoved
from kvstore.client.methods import Unary
from kvstore.errors import InvalidArgument
from service.server import Server
from tests.client.blocks import LAYOUT


def blocks_of(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 255, (n, LAYOUT.block_bytes), dtype=np.uint8)


def tokens_of(n: int, start: int) -> list[int]:
    return [start + t for t in range(n * LAYOUT.block_size)]


async def test_store_sends_the_checksums_of_the_bytes_written(
    kv: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = await kv.register_namespace("sums", LAYOUT)
    sent: list[Any] = []
    call = kv._rpc.call

    async def record(method: Unary, request: Any, *args: Any, **kw: Any) -> Any:
        sent.append((method.name, request))
        return await call(method, request, *args, **kw)

    monkeypatch.setattr(kv._rpc, "call", record)
    data = blocks_of(3, 1)
    assert (await kv.store(ns, tokens_of(3, 100), data)).committed == 3
    commit = next(req for name, req in sent if name == "Commit")
    expected = [block_checksum(row) for row in data]
    assert list(unpack_checksums(commit.packed_checksums, 3)) == expected

    hit = await kv.lookup(ns, tokens_of(3, 100), pin=True)
    assert hit.checksums.tolist() == expected
    assert [b.checksum for b in hit.blocks] == expected
    assert hit.check_bytes() == []
    await kv.release(hit)


async def test_check_bytes_names_the_blocks_whose_bytes_changed(kv: Client) -> None:
    ns = await kv.register_namespace("sums", LAYOUT)
    data = blocks_of(4, 2)
    await kv.store(ns, tokens_of(4, 200), data)
    hit = await kv.lookup(ns, tokens_of(4, 200), pin=True)
    buffers = hit.buffers()
    buffers[2][17] ^= 0x01  # one flipped bit in the pool
    assert hit.check_bytes() == [2]
    # The caller's own copies are checked when given.
    copies = [bytes(b) for b in buffers]
    copies[2], copies[3] = copies[3], copies[2]  # misplaced blocks
    assert hit.check_bytes(copies) == [2, 3]
    with pytest.raises(InvalidArgument, match="4 hit blocks, 3 buffers"):
        hit.check_bytes(copies[:3])
    await kv.release(hit)


async def test_an_unmapped_client_sends_checksums_with_write_blocks(kv_server: Server) -> None:
    async with Client(kv_server.address, tenant="acme", timeout=5.0, map_pool=False) as kv:
        ns = await kv.register_namespace("sums", LAYOUT)
        data = blocks_of(2, 3)
        assert (await kv.store(ns, tokens_of(2, 300), data)).committed == 2
        hit = await kv.lookup(ns, tokens_of(2, 300), pin=True)
        assert hit.checksums.tolist() == [block_checksum(row) for row in data]
        read = await kv.read_blocks(hit)
        assert hit.check_bytes(read) == []
        assert hit.check_bytes([read[1], read[0]]) == [0, 1]
        await kv.release(hit)


async def test_blocks_without_checksums_are_never_listed(kv: Client) -> None:
    ns = await kv.register_namespace("sums", LAYOUT)
    hit = await kv.lookup(ns, tokens_of(2, 400), pin=True)  # a miss: nothing to check
    assert hit.check_bytes() == []


@pytest.mark.parametrize(("setting", "verify"), [("peer", False), ("all", True)])
async def test_namespace_says_whether_the_operator_wants_loads_checked(
    server_config, clock, setting: str, verify: bool
) -> None:
    server = Server(dataclasses.replace(server_config, verify_checksums=setting), clock=clock)
    await server.start()
    try:
        async with Client(server.address, tenant="acme", timeout=5.0) as kv:
            ns = await kv.register_namespace("sums", LAYOUT)
            assert ns.verify_loads is verify
    finally:
        await server.stop(0.1)


def local_failures(server: Server, ns_id: str) -> float:
    """``kvstore_checksum_failures_total{tier="local"}`` of a namespace."""
    counter = server.node.metrics.checksum_failures.labels(ns_id, "local")
    return float(counter._value.get())


async def test_a_block_reported_corrupt_is_dropped_and_counted(
    kv: Client, kv_server: Server
) -> None:
    """Issue 40, item 7: a block that failed a local check stayed on the node, and every
    later load copied it, checked it and recomputed. Reported with the release, the
    node checks the slot itself, counts it and drops the block: later loads miss."""
    ns = await kv.register_namespace("sums", LAYOUT)
    await kv.store(ns, tokens_of(4, 500), blocks_of(4, 5))
    hit = await kv.lookup(ns, tokens_of(4, 500), pin=True)
    hit.buffers()[2][17] ^= 0x01  # one flipped bit in the pool
    assert hit.check_bytes() == [2]
    assert await kv.release(hit, corrupt=[2]) == 4
    assert local_failures(kv_server, ns.id) == 1
    again = await kv.lookup(ns, tokens_of(4, 500), pin=True)
    assert again.hit_blocks == 2  # the corrupt block is gone (and the chain stops there)
    await kv.release(again)


async def test_a_false_corrupt_report_drops_nothing(kv: Client, kv_server: Server) -> None:
    """The node believes no runner: it checks the slot, whose bytes are intact."""
    ns = await kv.register_namespace("sums", LAYOUT)
    await kv.store(ns, tokens_of(3, 600), blocks_of(3, 6))
    hit = await kv.lookup(ns, tokens_of(3, 600), pin=True)
    assert await kv.release(hit, corrupt=[0, 1, 2]) == 3
    assert local_failures(kv_server, ns.id) == 0
    again = await kv.lookup(ns, tokens_of(3, 600))
    assert again.hit_blocks == 3


async def test_a_corrupt_block_another_hit_pins_stays_until_its_reader_reports_it(
    kv: Client,
) -> None:
    ns = await kv.register_namespace("sums", LAYOUT)
    await kv.store(ns, tokens_of(2, 700), blocks_of(2, 7))
    first = await kv.lookup(ns, tokens_of(2, 700), pin=True)
    second = await kv.lookup(ns, tokens_of(2, 700), pin=True)
    first.buffers()[1][3] ^= 0x80
    assert await kv.release(first, corrupt=first.check_bytes()) == 2
    assert (await kv.lookup(ns, tokens_of(2, 700))).hit_blocks == 2  # still pinned
    assert await kv.release(second, corrupt=second.check_bytes()) == 2
    assert (await kv.lookup(ns, tokens_of(2, 700))).hit_blocks == 1


async def test_a_late_write_between_the_copy_and_the_checksum_is_not_committed_as_good(
    kv: Client,
) -> None:
    """Issue 40, item 2: the writer hashed its *slots* after the copy, so another
    writer's late copy landing in that gap was committed with a checksum of the
    wrong bytes, and every check then passed. It now hashes its source: readers see
    the mismatch. The late copy lands through another mapping of the pool, as a
    stalled process's would, while this store is between its copies."""
    ns = await kv.register_namespace("sums", LAYOUT)
    data = blocks_of(3, 9)
    assert ns.mapping is not None
    other = type(ns.mapping).open(ns.mapping.descriptor)  # the late writer's mapping
    try:

        def supply(i: int) -> np.ndarray:
            if i == 2:  # blocks 0 and 1 are in their slots: the late copy lands on them
                arena = np.frombuffer(other.arena_buffer(0), np.uint8)
                arena[: 2 * LAYOUT.block_bytes] = 0xEE  # this store's first two slots
            return data[i]

        assert (await kv.store(ns, tokens_of(3, 800), supply)).committed == 3
        hit = await kv.lookup(ns, tokens_of(3, 800), pin=True)
        assert list(hit.slots) == [0, 1, 2]  # a fresh pool: the slots the late copy hit
        assert hit.check_bytes() == [0, 1]  # the late bytes fail the writer's checksums
        await kv.release(hit, corrupt=[0, 1])
    finally:
        other.close()


async def test_copy_into_checks_each_copy_against_its_checksum_by_default(kv: Client) -> None:
    """Local loads are verified by default (``verify_checksums = "all"``): `copy_into`
    hashes each block's copy in the same pass and refuses the ones that fail."""
    ns = await kv.register_namespace("sums", LAYOUT)
    assert ns.verify_loads  # the node's default
    data = blocks_of(3, 11)
    await kv.store(ns, tokens_of(3, 900), data)
    hit = await kv.lookup(ns, tokens_of(3, 900), pin=True)
    out = np.zeros_like(data)
    assert hit.copy_into(out).intact == 3 and np.array_equal(out, data)
    hit.buffers()[1][5] ^= 0x10
    with pytest.raises(BlocksMoved) as err:
        hit.copy_into(out)
    assert (err.value.intact, err.value.moved, err.value.corrupt) == (1, (), (1,))
    await kv.release(hit, corrupt=err.value.corrupt)
    assert (await kv.lookup(ns, tokens_of(3, 900))).hit_blocks == 1  # dropped
