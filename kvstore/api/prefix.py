"""The routers' prefix-query answer: one type, its protobuf and its JSON forms.

The node builds a `PrefixAnswer` (`service.api.prefix_query`) and sends it as
a ``QueryPrefixResponse`` (gRPC) or as JSON (``POST /query``); the SDK and the
CLI read the response back into the same type, and the CLI's ``--json``
prints the same JSON as the HTTP route (less Conductor's ``instances``, which
only the HTTP route adds).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvstore.v1 import kvstore_pb2 as pb

__all__ = [
    "DISK_TIER",
    "ENGINE_TIER",
    "NODE_TIER",
    "SOURCE_DIRECTORY",
    "SOURCE_LOCAL",
    "PrefixAnswer",
    "PrefixHolder",
]

NODE_TIER = "kvstore"
"""The tier of a node's own pool (an engine's tier is its medium, e.g. "GPU")."""

ENGINE_TIER = "engine"
"""The tier of an engine that published no medium."""

DISK_TIER = "disk"
"""The tier of a node's disk tier: the blocks it serves from its pool and its disk together."""

SOURCE_DIRECTORY = "directory"
"""The answer came from the Redis directory: every live node and engine."""

SOURCE_LOCAL = "local"
"""The answer came from the asked node alone (standalone, or Redis away)."""


@dataclass(frozen=True, slots=True)
class PrefixHolder:
    """A node's pool, or an engine on a node, that holds a prefix of the query."""

    node_id: str
    """The node (an engine's node for an engine)."""
    address: str
    """The node's gRPC address ("" when it advertises none)."""
    tier: str
    """`NODE_TIER` for the node's pool, else the engine's medium (``"GPU"``, ...)."""
    engine: str
    """The engine's name; "" for the node's pool."""
    matched_blocks: int
    """Leading blocks of the query it holds."""
    matched_tokens: int
    """``matched_blocks * block_size``."""

    def to_proto(self) -> pb.PrefixHolder:
        """The wire form (the proto's fields are the dataclass's, by name)."""
        return pb.PrefixHolder(**self.to_json())

    @classmethod
    def from_proto(cls, msg: pb.PrefixHolder) -> PrefixHolder:
        """The holder a wire form names."""
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})

    def to_json(self) -> dict[str, Any]:
        """The JSON object of the holder: every field, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class PrefixAnswer:
    """Who holds the longest prefix of a prompt."""

    namespace_id: str
    model: str
    tenant_id: str
    """The tenant whose blocks were asked about."""
    block_size: int
    query_blocks: int
    """Full blocks in the query."""
    query_tokens: int
    """Tokens sent (for hashes: the full blocks' tokens)."""
    source: str
    """`SOURCE_DIRECTORY` (the cluster, from Redis) or `SOURCE_LOCAL` (the asked node alone)."""
    holders: tuple[PrefixHolder, ...] = ()
    """Longest first."""

    @property
    def longest_matched(self) -> int:
        """The most tokens any holder matched (0: nobody holds the first block).

        Mooncake Conductor's ``longest_matched``; derived from ``holders``, so it
        cannot disagree with them (the wire carries it for routers that read
        only that field).
        """
        return max((h.matched_tokens for h in self.holders), default=0)

    def to_proto(self) -> pb.QueryPrefixResponse:
        """The wire form (``QueryPrefixResponse``)."""
        return pb.QueryPrefixResponse(
            namespace_id=self.namespace_id,
            model=self.model,
            tenant_id=self.tenant_id,
            block_size=self.block_size,
            query_blocks=self.query_blocks,
            query_tokens=self.query_tokens,
            longest_matched=self.longest_matched,
            source=self.source,
            holders=[h.to_proto() for h in self.holders],
        )

    @classmethod
    def from_proto(cls, msg: pb.QueryPrefixResponse) -> PrefixAnswer:
        """The answer a ``QueryPrefixResponse`` carries (its ``longest_matched`` is derived)."""
        return cls(
            namespace_id=msg.namespace_id,
            model=msg.model,
            tenant_id=msg.tenant_id,
            block_size=msg.block_size,
            query_blocks=msg.query_blocks,
            query_tokens=msg.query_tokens,
            source=msg.source,
            holders=tuple(PrefixHolder.from_proto(h) for h in msg.holders),
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON document (``POST /query``'s fields, the CLI's ``--json``)."""
        return {
            "model": self.model,
            "namespace_id": self.namespace_id,
            "tenant_id": self.tenant_id,
            "block_size": self.block_size,
            "query_blocks": self.query_blocks,
            "query_tokens": self.query_tokens,
            "longest_matched": self.longest_matched,
            "source": self.source,
            "holders": [h.to_json() for h in self.holders],
        }
