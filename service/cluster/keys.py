"""Every Redis key the cluster uses, and the one byte packing of directory members.

Keys are designed for Redis Cluster: a Lua script may only touch keys of one
hash slot, so each script's keys share a ``{hash tag}``:

- ``{P}:nodes``  HASH node_id -> JSON info (address, devices, capacity, used, version)
- ``{P}:alive``  ZSET node_id -> heartbeat deadline (Redis ``TIME``, ms)
- ``{P}:events`` STREAM of cache and node events (``MAXLEN ~``)
- ``{P}:namespaces`` SET of namespace ids ever published (so a restarted node
  can clear entries of namespaces it no longer has)

and per namespace, in the namespace's own slot (namespaces spread over the
cluster; one Locate touches exactly one slot):

- ``{P:ns}:alive`` ZSET node_id -> deadline (refreshed by every heartbeat)
- ``{P:ns}:addr``  HASH node_id -> gRPC address peers fetch from
- ``{P:ns}:n:<node_id>`` SET of members, one per READY block the node holds
- ``{P:ns}:d:<node_id>`` SET of members, one per block on the node's disk tier
  (docs/disk.md); a Locate counts a block in either of the node's sets
- ``{P:ns}:e:<node_id>:<engine>`` SET of members, one per block an engine of
  the node holds (ingested from the engine's vLLM KV events; docs/events.md)
- ``{P:ns}:engines`` HASH ``<node_id>:<engine>`` -> JSON {"node", "engine", "medium"}

``P`` is `Config.redis_key_prefix`. A member is ``hash (32 bytes) + scope``
(scope = tenant, empty for shared namespaces), so the directory never
credits a block to another tenant: a Locate asks with the caller's scope.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass

from kvstore.types import BlockHash, NamespaceId, TenantId

HASH_BYTES = 32
"""Length of a block hash; members start with one."""


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix (one cluster of nodes per prefix)."""

    prefix: str = "kvstore"
    """The `redis_key_prefix`; two clusters can share one Redis with two prefixes."""

    @property
    def nodes(self) -> str:
        """HASH node_id -> JSON info."""
        return f"{{{self.prefix}}}:nodes"

    @property
    def alive(self) -> str:
        """ZSET node_id -> heartbeat deadline in Redis ms."""
        return f"{{{self.prefix}}}:alive"

    @property
    def events(self) -> str:
        """The cluster-wide event stream."""
        return f"{{{self.prefix}}}:events"

    @property
    def namespaces(self) -> str:
        """SET of namespace ids with directory entries."""
        return f"{{{self.prefix}}}:namespaces"

    def ns_tag(self, namespace: NamespaceId | str) -> str:
        """The hash tag of one namespace's keys."""
        return f"{{{self.prefix}:{namespace}}}"

    def ns_alive(self, namespace: NamespaceId | str) -> str:
        """ZSET node_id -> deadline, in the namespace's slot."""
        return f"{self.ns_tag(namespace)}:alive"

    def ns_addr(self, namespace: NamespaceId | str) -> str:
        """HASH node_id -> gRPC address, in the namespace's slot."""
        return f"{self.ns_tag(namespace)}:addr"

    def ns_node_prefix(self, namespace: NamespaceId | str) -> str:
        """Prefix of the per-node block sets (the Locate script appends the node id)."""
        return f"{self.ns_tag(namespace)}:n:"

    def ns_node(self, namespace: NamespaceId | str, node_id: str) -> str:
        """SET of the members a node holds in a namespace."""
        return self.ns_node_prefix(namespace) + node_id

    def ns_disk_prefix(self, namespace: NamespaceId | str) -> str:
        """Prefix of the per-node disk-tier sets (the scripts append the node id)."""
        return f"{self.ns_tag(namespace)}:d:"

    def ns_disk(self, namespace: NamespaceId | str, node_id: str) -> str:
        """SET of the members on a node's disk tier in a namespace."""
        return self.ns_disk_prefix(namespace) + node_id

    def ns_engines(self, namespace: NamespaceId | str) -> str:
        """HASH ``<node_id>:<engine>`` -> JSON {node, engine, medium}, in the namespace's slot."""
        return f"{self.ns_tag(namespace)}:engines"

    def ns_engine(self, namespace: NamespaceId | str, node_id: str, engine: str) -> str:
        """SET of the members one engine of a node holds in a namespace."""
        return f"{self.ns_tag(namespace)}:e:{engine_field(node_id, engine)}"


def engine_field(node_id: str, engine: str) -> str:
    """The ``{P:ns}:engines`` field (and key suffix) of one engine of one node."""
    return f"{node_id}:{engine}"


def member(block_hash: BlockHash | bytes, scope: TenantId | str) -> bytes:
    """The directory member of one block: its hash then its scope."""
    return bytes(block_hash) + scope.encode()


def split_member(value: bytes) -> tuple[BlockHash, TenantId]:
    """The (hash, scope) of a member (inverse of `member`)."""
    return BlockHash(value[:HASH_BYTES]), TenantId(value[HASH_BYTES:].decode())


# --- Redis Cluster hash slots (CRC16/XMODEM of the tag, mod 16384) -------------


def key_slot(key: str | bytes) -> int:
    """The Redis Cluster slot of ``key`` (honours ``{hash tags}``)."""
    raw = key.encode() if isinstance(key, str) else key
    start = raw.find(b"{")
    if start != -1:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1 : end]
    return binascii.crc_hqx(raw, 0) % 16384
