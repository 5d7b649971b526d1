"""Hit.verify and Hit.copy_into against a real node: a copied block whose slot moved is caught."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvstore.client import BlocksMoved, Client, Verification
from kvstore.pool.stamps import idents_of
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.server import Server
from tests.client.blocks import LAYOUT

TOKENS = list(range(1000, 1000 + 4 * 5))
"""Five full blocks."""
POOL_BLOCKS = 16
"""The test node's arenas are 16 blocks: a namespace capped at one arena holds 16."""


def block(i: int) -> np.ndarray:
    return np.full(LAYOUT.block_shape, i + 0.5, np.float16)


async def test_verify_reports_blocks_rewritten_after_the_copy(kv: Client) -> None:
    ns = await kv.register_namespace("m", LAYOUT, capacity_bytes=POOL_BLOCKS * LAYOUT.block_bytes)
    await kv.store(ns, TOKENS, [block(i) for i in range(5)])
    hit = await kv.lookup(ns, TOKENS, pin=True)
    assert hit.mapping is not None and hit.mapping.has_stamps
    # What a reader expects: the lookup's (READY) generations and the hashes' idents.
    expected = hit.expected_stamps
    assert expected.tolist() == hit.mapping.read_stamps(hit.slots).tolist()
    assert expected[:, 1].tolist() == idents_of(hit.hit_hashes).tolist()
    copies = [view.copy() for view in hit.numpy_views()]
    assert hit.verify() == Verification(intact=5, moved=(), checked=5)
    await kv.release(hit)
    # Another writer fills the pool: the released blocks are evicted and their
    # slots rewritten. The copies taken before are not proven any more.
    other = list(range(50_000, 50_000 + 4 * POOL_BLOCKS))
    result = await kv.store(ns, other, [block(100 + i) for i in range(POOL_BLOCKS)])
    assert result.committed == POOL_BLOCKS
    verification = hit.verify()
    assert verification.intact == 0 and verification.moved == (0, 1, 2, 3, 4)
    assert not verification.ok and len(copies) == 5
    assert hit.verify(count=0) == Verification(0, (), 0)


async def test_copy_into_raises_when_pins_are_dropped_under_it(kv_server: Server) -> None:
    async with (
        Client(kv_server.address, tenant="acme", timeout=5.0) as kv,
        grpc.aio.insecure_channel(kv_server.address) as channel,
    ):
        ns = await kv.register_namespace("m", LAYOUT)
        await kv.store(ns, TOKENS, [block(i) for i in range(5)])
        hit = await kv.lookup(ns, TOKENS, pin=True)
        out = np.zeros((5, *LAYOUT.block_shape), np.float16)
        assert hit.copy_into(out).intact == 5
        assert np.array_equal(out[4], block(4))
        # An operator drops the namespace with force: pins go, the slots are
        # freed. The mapping still reads the old memory; its stamps say so.
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        await stub.DropNamespace(pb.DropNamespaceRequest(namespace_id=ns.id, force=True))
        with pytest.raises(BlocksMoved) as caught:
            hit.copy_into(out)
        assert caught.value.intact == 0 and caught.value.moved == (0, 1, 2, 3, 4)
