"""The disk tier's blocks named as the rest of the node names blocks.

The tier keys a block by (16-byte namespace digest, u64 scope digest, 32-byte
hash) and keeps each scope's name (`DiskTier.scope_names`); the Redis
directory, the node's KV events and peer fetch name it by (namespace id,
tenant scope, hash). `DiskNames` translates, so the tier's `DiskEvent`s
become `CacheEvent`s (BlockStored / BlockRemoved with the disk medium, the
directory's disk set) and a resync can list every block on disk. A block of
a namespace not registered on this node (yet) has no name: it is published
when the namespace is registered (`NodeDisk.registered`).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstore.events import CacheEvent, EventKind
from kvstore.layout import NamespaceSpec
from kvstore.types import BlockHash, NamespaceId, TenantId
from service.cluster.keys import member
from service.disk.entry import Key
from service.disk.stats import DiskEvent, DiskEventKind

DISK_MEDIUM = "disk"
"""The medium the disk tier's blocks are published with (KV events, the directory)."""

_KINDS = {DiskEventKind.STORED: EventKind.STORED, DiskEventKind.REMOVED: EventKind.REMOVED}


class DiskNames:
    """Namespace digests and scope digests back to the names the node uses."""

    def __init__(self, scopes: dict[int, bytes]) -> None:
        """``scopes``: the tier's scope names (`DiskTier.scope_names`), read as they grow."""
        self._scopes = scopes
        self._namespaces: dict[bytes, NamespaceId] = {}

    def learn(self, key: bytes, spec: NamespaceSpec) -> None:
        """Name the namespace whose disk digest is ``key`` (registered, or being dropped)."""
        self._namespaces[key] = spec.namespace_id

    def forget(self, key: bytes) -> None:
        """The namespace is gone: its blocks have no name any more."""
        self._namespaces.pop(key, None)

    def namespace(self, key: bytes) -> NamespaceId | None:
        return self._namespaces.get(key)

    def scope(self, scope: int) -> TenantId | None:
        name = self._scopes.get(scope)
        return None if name is None else TenantId(name.decode(errors="replace"))

    def cache_events(self, events: Iterable[DiskEvent], at: float) -> list[CacheEvent]:
        """``events`` as `CacheEvent`s, one per run of the same kind, namespace and scope;
        blocks without a name are left out."""
        out: list[CacheEvent] = []
        run: list[BlockHash] = []
        head: tuple[EventKind, NamespaceId, TenantId] | None = None
        for ev in events:
            k = ev.key
            namespace, scope = self.namespace(k.namespace), self.scope(k.scope)
            if namespace is None or scope is None:
                continue
            this = (_KINDS[ev.kind], namespace, scope)
            if this != head and head is not None and run:
                out.append(CacheEvent(*head, tuple(run), at=at))
                run = []
            head = this
            run.append(BlockHash(k.block_hash))
        if head is not None and run:
            out.append(CacheEvent(*head, tuple(run), at=at))
        return out

    def members(self, keys: Iterable[Key]) -> list[bytes]:
        """The directory members (`service.cluster.keys.member`) of blocks on disk."""
        out: list[bytes] = []
        for _, scope_digest, block_hash in keys:
            scope = self.scope(scope_digest)
            if scope is not None:
                out.append(member(block_hash, scope))
        return out
