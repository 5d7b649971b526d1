"""Stand-ins for the node's peers: a fetch that commits straight into the store."""

from __future__ import annotations

from kvstore.types import BlockHash, LeaseId, NamespaceId, TenantId


class StoringPeers:
    """Fetches by committing the missing blocks straight into the store."""

    def __init__(self, node) -> None:
        self.node = node

    async def fetch(
        self, namespace: NamespaceId, tenant: TenantId, chain: list[BlockHash], have: int
    ) -> int:
        store, now = self.node.store, self.node.now()
        lease = LeaseId(0x5EED)
        store.open_lease(lease, tenant, 5.0, now)
        store.reserve(namespace, tenant, lease, chain, now)
        store.commit(namespace, tenant, lease, chain[have:], now)
        store.close_lease(lease, tenant, now)
        return len(chain) - have

    async def close(self) -> None:
        """Nothing to close (the server's shutdown calls it)."""
