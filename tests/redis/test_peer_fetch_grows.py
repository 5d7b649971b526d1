"""A peer fetch longer than the local pool's first arena grows the pool instead of failing."""

from __future__ import annotations

from tests.redis.rpc import Rpc, block_bytes
from tests.waiting import until


async def test_peer_fetch_grows_the_local_pool(nodes):
    a = await nodes.start("node-a")
    b = await nodes.start("node-b", pool_headroom_bytes=0)  # grows on need only
    ra, rb = Rpc(a.address, "acme"), Rpc(b.address, "acme")
    try:
        await ra.register()
        await rb.register()  # one arena of 32 blocks on node-b
        chain = await ra.store(seed=11, blocks=50)
        await until(lambda: b.node.cluster.locate(ra.namespace, "acme", chain), what="entry")
        hit = await rb.lookup(11, 50, remote=True)
        assert hit.hit_blocks == 50
        assert await rb.read(11, 50) == [block_bytes(11, i) for i in range(50)]
        (ns,) = b.node.store.stats().namespaces
        assert ns.capacity == 64 and ns.evictions == 0  # grew by one 32-block arena
    finally:
        await ra.close()
        await rb.close()
