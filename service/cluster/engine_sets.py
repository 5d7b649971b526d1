"""Engine holdings on Redis: which blocks the serving engines of each node hold.

A node that ingests its engines' vLLM KV events (`service.vllm_events`) mirrors
its engine index here, per namespace and engine (keys in
`service.cluster.keys`):

- ``{P:ns}:e:<node_id>:<engine>`` SET of members ``hash (32 bytes) || scope``,
  exactly like the node's own ``{P:ns}:n:<node_id>`` set, with the node TTL
  (``PEXPIRE``) refreshed by every heartbeat;
- ``{P:ns}:engines`` HASH field ``<node_id>:<engine>`` -> JSON
  ``{"node": ..., "engine": ..., "medium": ...}``, the engines a reader scans.

Writes are batched like the node's directory: the engine index queues
changes in a bounded `EngineSetQueue` (synchronous, on the loop); the Redis
agent drains it in its flush pipeline. An overflow, a Redis outage or a start
marks a resync: the node's engine entries are wiped and rewritten from the
index. A graceful leave deletes them; a dead node's sets expire with its TTL,
and its hash fields are removed by the next heartbeat of any live node in the
namespace (``NS_HEARTBEAT`` in `service.cluster.directory`); until then they
name a node that ``{P:ns}:alive`` no longer lists as live, which readers check.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvstore.types import NamespaceId
from service.cluster.directory import Change, ChangeQueue
from service.cluster.keys import Keys, engine_field


@dataclass(frozen=True, slots=True)
class EngineChange:
    """Members added to or removed from one engine's set in one namespace."""

    change: Change
    namespace: NamespaceId
    engine: str
    medium: str
    """The engine's media, as the hash field's JSON names them."""
    members: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class EngineEntry:
    """One engine's full set in one namespace (a resync writes these)."""

    namespace: NamespaceId
    engine: str
    medium: str
    members: tuple[bytes, ...]


class EngineHoldings(Protocol):
    """What the agent needs of the node's engine index."""

    queue: EngineSetQueue | None

    def entries(self) -> list[EngineEntry]:
        """Every engine's set in every namespace, for a resync."""

    def live_sets(self) -> list[tuple[NamespaceId, str, str]]:
        """The (namespace, engine, medium) of every non-empty set, for the heartbeat."""


class EngineSetQueue(ChangeQueue[EngineChange]):
    """The engines' set changes awaiting a flush (see `ChangeQueue`)."""

    def __init__(self, limit_members: int, wake: Callable[[], None] | None = None) -> None:
        """``wake``: called on every put (the agent's flush wakes up)."""
        super().__init__(limit_members)
        self._wake = wake

    def put(
        self,
        change: Change,
        namespace: NamespaceId,
        engine: str,
        medium: str,
        members: Sequence[bytes],
    ) -> None:
        """Queue one change; on overflow drop everything and ask for a resync."""
        if self.needs_resync or not members:
            return
        queued = self.append(EngineChange(change, namespace, engine, medium, tuple(members)))
        if queued and self._wake is not None:
            self._wake()


class EngineSets:
    """Writes of this node's engine entries (commands queued on a pipeline)."""

    def __init__(self, keys: Keys, node_id: str, ttl_ms: int) -> None:
        self.keys = keys
        self.node_id = node_id
        self.ttl_ms = ttl_ms

    def _describe(self, pipe: Any, namespace: NamespaceId, engine: str, medium: str) -> None:
        doc = {"node": self.node_id, "engine": engine, "medium": medium}
        pipe.hset(
            self.keys.ns_engines(namespace),
            engine_field(self.node_id, engine),
            json.dumps(doc, sort_keys=True),
        )

    def write_changes(self, pipe: Any, changes: Iterable[EngineChange]) -> None:
        """Queue the commands of ``changes`` (order kept per set)."""
        touched: dict[tuple[NamespaceId, str], str] = {}
        for item in changes:
            key = self.keys.ns_engine(item.namespace, self.node_id, item.engine)
            if item.change is Change.ADD:
                pipe.sadd(key, *item.members)
                touched[(item.namespace, item.engine)] = item.medium
            else:
                pipe.srem(key, *item.members)
        for (namespace, engine), medium in touched.items():
            pipe.pexpire(self.keys.ns_engine(namespace, self.node_id, engine), self.ttl_ms)
            self._describe(pipe, namespace, engine, medium)

    def write_snapshot(self, pipe: Any, entries: Iterable[EngineEntry], chunk: int = 1000) -> None:
        """Queue every engine's full set (after `wipe`)."""
        for entry in entries:
            if not entry.members:
                continue
            key = self.keys.ns_engine(entry.namespace, self.node_id, entry.engine)
            for start in range(0, len(entry.members), chunk):
                pipe.sadd(key, *entry.members[start : start + chunk])
            pipe.pexpire(key, self.ttl_ms)
            self._describe(pipe, entry.namespace, entry.engine, entry.medium)
            pipe.sadd(self.keys.namespaces, entry.namespace)

    async def wipe(self, client: Any, namespaces: Iterable[str]) -> None:
        """Delete this node's engine sets and hash fields in ``namespaces`` (reads the hashes)."""
        for namespace in namespaces:
            fields = [
                f.decode() if isinstance(f, bytes) else f
                for f in await client.hkeys(self.keys.ns_engines(namespace))
            ]
            # Engine names hold no ":", so the node id is what precedes the last one.
            mine = [f for f in fields if f.rpartition(":")[0] == self.node_id]
            if not mine:
                continue
            pipe = client.pipeline(transaction=False)
            for field in mine:
                engine = field.rpartition(":")[2]
                pipe.delete(self.keys.ns_engine(namespace, self.node_id, engine))
            pipe.hdel(self.keys.ns_engines(namespace), *mine)
            await pipe.execute()

    def refresh(self, pipe: Any, live: Iterable[tuple[NamespaceId, str, str]]) -> None:
        """Queue the heartbeat of the given (namespace, engine, medium) sets: their TTL, and
        their hash field (another node's heartbeat may have swept it in the moment before
        this node's first heartbeat made it live)."""
        for namespace, engine, medium in live:
            pipe.pexpire(self.keys.ns_engine(namespace, self.node_id, engine), self.ttl_ms)
            self._describe(pipe, namespace, engine, medium)
