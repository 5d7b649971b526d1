"""NIXL as the data plane of peer fetch: the agent, its offers and its reads, started together.

`peer_transport` decides: ``grpc`` never starts NIXL; ``nixl`` requires it
(a node that cannot start it refuses to start, exit code 2); ``auto`` starts
it when the `nixl` package imports and its agent comes up, else logs one
line and streams over gRPC. A node on a GPU (CUDA pools) does not offer or
use NIXL yet: its peer fetches stream over gRPC.
"""

from __future__ import annotations

import logging

from service.cluster.local import LocalNode
from service.cluster.nixl_agent import NixlAgent, NixlUnavailable
from service.cluster.nixl_fetch import NixlPuller
from service.cluster.nixl_offers import OfferBook
from service.config import ConfigError

log = logging.getLogger(__name__)


class NixlTransport:
    """The node's NIXL agent, the offers it makes as holder and the READs it makes as reader."""

    def __init__(self, node: LocalNode, agent: NixlAgent) -> None:
        """Bundle a started agent; use `start`."""
        self.node = node
        self.agent = agent
        self.offers = OfferBook(node, agent)
        self.puller = NixlPuller(node, agent)

    @classmethod
    def start(cls, node: LocalNode) -> NixlTransport | None:
        """Start NIXL as `peer_transport` says; None when peer fetch streams over gRPC.

        Registers every arena of the node's pools now and each one added later.

        Raises:
            ConfigError: ``peer_transport = "nixl"`` and NIXL cannot be used here.
        """
        mode = node.config.peer_transport
        if mode == "grpc":
            return None
        if node.pools.kind != "host":
            if mode == "nixl":
                raise ConfigError("peer_transport nixl: NIXL serves host pools only, for now")
            log.info("peer fetch streams over gRPC: NIXL serves host pools only, for now")
            return None
        try:
            agent = NixlAgent.create(f"kvstore-{node.node_id}-{node.epoch:x}")
        except NixlUnavailable as exc:
            if mode == "nixl":
                raise ConfigError(f"peer_transport nixl: {exc}") from None
            log.info("peer fetch streams over gRPC: %s", exc)
            return None
        node.pools.watch(agent)
        log.info("peer fetch moves bytes with NIXL (agent %s)", agent.name)
        return cls(node, agent)

    async def close(self) -> None:
        """End open offers, finish background work, deregister every arena."""
        self.offers.close()
        await self.puller.close()
        if self.node.pools.watcher is self.agent:
            self.node.pools.unwatch()
        self.agent.close()
