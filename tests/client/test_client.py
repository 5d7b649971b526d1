"""The async client against a real in-process server."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from kvstore.client import Client, PoolEpochChanged, SyncClient
from kvstore.client.methods import Unary
from kvstore.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from kvstore.layout import KVLayout
from kvstore.results import MissReason
from kvstore.types import SlotId
from service.server import Server
from tests.client.blocks import LAYOUT, TOKENS, block


async def writing(kv: Client) -> int:
    stats = await kv.stats()
    return int(stats.writing) + sum(int(ns.writing) for ns in stats.namespaces)


async def test_store_then_lookup_same_bytes(kv: Client) -> None:
    ns = await kv.register_namespace("m", LAYOUT)
    assert ns.block_bytes == LAYOUT.block_bytes and ns.mapping is not None
    result = await kv.store(ns, TOKENS, [block(i) for i in range(5)])
    assert (result.reserved, result.committed, result.hit) == (5, 5, 0)
    assert result.chain == tuple(ns.hash(TOKENS))

    hit = await kv.lookup(ns, TOKENS, pin=True)
    assert (hit.hit_blocks, hit.hit_tokens, hit.pinned) == (5, 20, True)
    assert hit.miss_reason is MissReason.NONE
    for i, view in enumerate(hit.numpy_views()):
        assert np.array_equal(view, block(i))
    for i, tensor in enumerate(hit.torch_views()):
        assert tensor.dtype == torch.float16 and float(tensor[0, 0, 0, 0, 0]) == i + 0.5
    assert await kv.read_blocks(hit) == [block(i).tobytes() for i in range(5)]
    assert await kv.release(hit) == 5

    again = await kv.store(ns, TOKENS, lambda i: pytest.fail("nothing to write"))
    assert (again.reserved, again.hit) == (0, 5)


async def test_lookup_by_hashes_and_partial(kv: Client) -> None:
    ns = await kv.register_namespace("m", LAYOUT)
    await kv.store(ns, TOKENS[:8], [block(0), block(1)])
    hit = await kv.lookup(ns, hashes=ns.hash(TOKENS))
    assert hit.hit_blocks == 2 and not hit.pinned
    assert hit.miss_reason is MissReason.ABSENT
    assert await kv.release(hit) == 0


async def test_register_is_cached_and_conflicts_are_typed(kv: Client) -> None:
    ns = await kv.register_namespace("m", LAYOUT)
    assert await kv.register_namespace("m", LAYOUT) is ns
    other = dataclasses.replace(LAYOUT, num_layers=3)
    with pytest.raises(AlreadyExists):
        await kv.register_namespace("m", other)


async def test_failing_block_aborts_reservation(kv: Client) -> None:
    ns = await kv.register_namespace("m", LAYOUT)

    def blocks(i: int) -> np.ndarray:
        if i == 3:
            raise RuntimeError("model crashed")
        return block(i)

    with pytest.raises(RuntimeError, match="model crashed"):
        await kv.store(ns, TOKENS, blocks)
    assert await writing(kv) == 0
    assert (await kv.lookup(ns, TOKENS)).hit_blocks == 0
    # The slots were freed: another store writes them all.
    assert (await kv.store(ns, TOKENS, [block(i) for i in range(5)])).committed == 5


async def test_wrong_size_block_aborts(kv: Client) -> None:
    ns = await kv.register_namespace("m", LAYOUT)
    with pytest.raises(InvalidArgument, match="256 bytes"):
        await kv.store(ns, TOKENS, [b"short"] * 5)
    assert await writing(kv) == 0


async def test_cancelled_store_aborts(kv: Client) -> None:
    ns = await kv.register_namespace("m", LAYOUT)
    entered = asyncio.Event()

    async def slow_commit(*args: object, **kwargs: object) -> object:
        entered.set()
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    real_call = kv._rpc.call

    async def call(method: Unary, *args: object, **kwargs: object) -> object:
        if method.name == "Commit":
            return await slow_commit()
        return await real_call(method, *args, **kwargs)  # type: ignore[arg-type]

    kv._rpc.call = call  # type: ignore[method-assign]
    task = asyncio.ensure_future(kv.store(ns, TOKENS, [block(i) for i in range(5)]))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    kv._rpc.call = real_call  # type: ignore[method-assign]
    assert await writing(kv) == 0


async def test_release_twice_is_harmless(kv: Client) -> None:
    ns = await kv.register_namespace("m", LAYOUT)
    await kv.store(ns, TOKENS, [block(i) for i in range(5)])
    first = await kv.lookup(ns, TOKENS, pin=True)
    second = await kv.lookup(ns, TOKENS, pin=True)
    assert (await kv.stats()).pinned == 10
    assert await kv.release(first) == 5
    assert await kv.release(first) == 0  # sends nothing: the other hit keeps its pins
    assert (await kv.stats()).pinned == 5
    with pytest.raises(FailedPrecondition, match="released"):
        first.numpy_views()
    assert await kv.release(second) == 5
    assert (await kv.stats()).pinned == 0


async def test_views_of_an_unpinned_hit_are_refused(kv: Client) -> None:
    """Nothing holds an unpinned hit's slots: once evicted and reused they hold other
    blocks, which its views would show silently. Reading needs pin=True."""
    ns = await kv.register_namespace("m", LAYOUT)
    await kv.store(ns, TOKENS, [block(i) for i in range(5)])
    hit = await kv.lookup(ns, TOKENS)  # pin=False: how much is cached, no more
    assert (hit.hit_blocks, hit.pinned) == (5, False)
    for read in (
        hit.numpy_views,
        hit.buffers,
        hit.torch_views,
        lambda: hit.copy_into(np.zeros(5 * ns.block_bytes, np.uint8)),
    ):
        with pytest.raises(FailedPrecondition, match="pin=False"):
            read()
    with pytest.raises(FailedPrecondition):
        await kv.read_blocks(hit)
    miss = await kv.lookup(ns, list(range(7, 7 + 8)))
    assert miss.numpy_views() == []  # a miss has nothing to show, pinned or not
    pinned = await kv.lookup(ns, TOKENS, pin=True)
    assert np.array_equal(pinned.numpy_views()[2], block(2))
    await kv.release(pinned)


async def test_epoch_change_drops_mappings(kv_server: Server) -> None:
    async with Client(kv_server.address, tenant="acme", timeout=5.0) as kv:
        ns = await kv.register_namespace("m", LAYOUT)
        await kv.store(ns, TOKENS, [block(i) for i in range(5)])
        hit = await kv.lookup(ns, TOKENS)
        old_mapping = ns.mapping
        assert old_mapping is not None and kv.epoch == old_mapping.descriptor.epoch

        # Restart the node on the same port: new epoch, new (empty) pools.
        port = kv_server.port
        await kv_server.stop(0.1)
        config = dataclasses.replace(kv_server.config, port=port)
        restarted = Server(config)
        await restarted.start()
        try:
            again = await kv.lookup(ns, TOKENS)  # re-registers and re-attaches transparently
            assert again.hit_blocks == 0
            assert old_mapping.closed
            assert ns.mapping is not None and ns.mapping is not old_mapping
            assert kv.epoch == ns.mapping.descriptor.epoch != hit.epoch
            with pytest.raises(PoolEpochChanged):
                hit.numpy_views()
            stored = await kv.store(ns, TOKENS, [block(i) for i in range(5)])
            assert stored.committed == 5
            hit = await kv.lookup(ns, TOKENS, pin=True)
            assert np.array_equal(hit.numpy_views()[4], block(4))
            await kv.release(hit)
        finally:
            await kv.close()
            await restarted.stop(0.1)


async def test_a_reader_follows_the_epoch_another_clients_lookup_saw(kv_server: Server) -> None:
    """The vLLM worker's case: it only reads what its scheduler looked up, so no call of its
    own meets a node restart; given the lookup's epoch it registers and maps again."""
    async with (
        Client(kv_server.address, tenant="acme", timeout=5.0) as writer,
        Client(kv_server.address, tenant="acme", timeout=5.0) as reader,
    ):
        ns_w = await writer.register_namespace("m", LAYOUT)
        ns_r = await reader.register_namespace("m", LAYOUT)
        old_mapping = ns_r.mapping
        assert old_mapping is not None
        await reader.follow_epoch(ns_r, old_mapping.descriptor.epoch)  # mapped at it: no-op
        assert ns_r.mapping is old_mapping

        port = kv_server.port
        await kv_server.stop(0.1)
        restarted = Server(dataclasses.replace(kv_server.config, port=port))
        await restarted.start()
        try:
            assert (await writer.lookup(ns_w, TOKENS)).hit_blocks == 0  # re-registers
            assert (await writer.store(ns_w, TOKENS, [block(i) for i in range(5)])).committed == 5
            hit = await writer.lookup(ns_w, TOKENS, pin=True)
            assert hit.epoch != old_mapping.descriptor.epoch
            await reader.follow_epoch(ns_r, hit.epoch)
            assert old_mapping.closed and ns_r.epoch == hit.epoch and not ns_r.stale
            assert ns_r.mapping is not None
            # The reader reads the writer's block through its new mapping.
            assert bytes(ns_r.mapping.buffer(SlotId(int(hit.slots[4])))) == block(4).tobytes()
            await writer.release(hit)
        finally:
            await writer.close()
            await reader.close()
            await restarted.stop(0.1)


async def test_client_without_mapping_streams(kv_server: Server) -> None:
    async with Client(kv_server.address, map_pool=False) as kv:
        ns = await kv.register_namespace("m", LAYOUT)
        assert ns.mapping is None
        result = await kv.store(
            ns,
            TOKENS,
            [torch.full(LAYOUT.block_shape, float(i), dtype=torch.float16) for i in range(5)],
        )
        assert result.committed == 5
        hit = await kv.lookup(ns, TOKENS, pin=True)
        data = await kv.read_blocks(hit)
        assert np.frombuffer(data[2], np.float16)[0] == 2.0
        with pytest.raises(FailedPrecondition, match="not mapped"):
            hit.numpy_views()
        await kv.release(hit)


async def test_ping_and_lease(kv: Client) -> None:
    assert await kv.ping(b"hello") == b"hello"
    assert kv.lease.lease_id is None  # opened on first need
    ns = await kv.register_namespace("m", LAYOUT)
    await kv.lookup(ns, TOKENS, pin=True)
    assert kv.lease.lease_id is not None
    assert (await kv.stats()).leases == 1


async def test_sync_client(kv_server: Server) -> None:
    # The server runs on this test's loop: drive the blocking client from a thread.
    await asyncio.to_thread(sync_session, kv_server.address)


def sync_session(address: str) -> None:
    with SyncClient(address, tenant="acme") as kv:
        ns = kv.register_namespace("m", KVLayout(1, 1, 4, 4, "bfloat16"))
        assert kv.store(ns, TOKENS, [bytes([i]) * ns.block_bytes for i in range(5)]).committed == 5
        hit = kv.lookup(ns, TOKENS, pin=True)
        views = hit.torch_views()
        assert views[3].dtype == torch.bfloat16
        assert bytes(hit.buffers()[3]) == bytes([3]) * ns.block_bytes
        del views
        assert kv.release(hit) == 5
        assert kv.ping(b"x") == b"x"
