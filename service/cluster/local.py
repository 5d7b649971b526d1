"""What the cluster code needs of its node, as a protocol.

`RedisAgent` and `PeerFetcher` work on the node that owns them, and the node
(`service.node.Node`) creates them: with this protocol the dependency points
one way, from the node down to the cluster package, and never back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvstore.block_table import BlockTable
from kvstore.pool.base import BlockPool
from kvstore.store import Store
from kvstore.types import BlockHash, NamespaceId, TenantId
from service.config import Config
from service.memory.budget import PoolManager


class LocalNode(Protocol):
    """The node a Redis agent mirrors and a peer fetcher writes into."""

    @property
    def config(self) -> Config:
        """The node's resolved configuration."""

    @property
    def node_id(self) -> str:
        """This node's id in the registry and the directory."""

    @property
    def version(self) -> str:
        """The kvstore version the node runs (advertised in the registry)."""

    @property
    def epoch(self) -> int:
        """The pool epoch (random per server start)."""

    @property
    def store(self) -> Store:
        """The node's store (driven from the event loop only)."""

    @property
    def pools(self) -> PoolManager:
        """The node's pools (capacity is advertised in the registry)."""

    def now(self) -> float:
        """The store's notion of now (monotonic seconds)."""

    def table(self, namespace: NamespaceId) -> BlockTable:
        """A registered namespace's table."""

    def pool(self, namespace: NamespaceId) -> BlockPool:
        """A registered namespace's pool."""

    async def make_room(
        self, table: BlockTable, tenant: TenantId, chain: Sequence[BlockHash]
    ) -> None:
        """Grow a namespace's pool before a reserve of ``chain`` if the budget allows."""

    def checksum_failed(
        self, namespace: NamespaceId, tier: str, block_hash: BlockHash, holder: str
    ) -> None:
        """Count and log a block whose bytes did not match its checksum (it is not served)."""

    def publish_events(self) -> None:
        """Fan out the store's pending events (to watchers and to the agent)."""
