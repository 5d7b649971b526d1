"""The node's agent on Redis: heartbeat, directory flushes, resync, reconnects.

One background task owns every write to Redis, so ordering is simple:

    loop:
        if the directory needs a resync: heartbeat, then wipe this node's
            entries and rewrite them from a store snapshot
        every heartbeat_seconds: registry heartbeat + per-namespace liveness;
            this node missing from the registry: resync
        flush: queued directory changes and events, one pipeline
        Redis error: count the node as disconnected, mark for resync, wait
            backoff.compute(failures) (redis-py's backoff), try again

`Node.publish_events` hands the agent each `CacheEvent` synchronously
(`publish`), `Node.publish_disk_events` each of the disk tier's (`publish` with
tier "disk": its disk sets, stream entries with that tier); nothing an RPC does
ever waits on Redis. While Redis is away,
directory changes are buffered up to `directory_queue_blocks`, then dropped
(a resync rewrites them anyway), and events are buffered up to the same bound
(oldest dropped, counted). A resync happens at start, after every failed
Redis command, after an overflow, and when a heartbeat finds this node's
registry entry gone although no command failed (Redis restarted empty within
redis-py's silent reconnect, or flushed; or this node stalled past its TTL):
the node's whole entry is rebuilt from its store, so a restarted or cleared
node never leaves stale entries, and a Redis that lost them gets them back
within one heartbeat. Each resync beats first, so a loss after that beat is
seen by the next one.

Reads (`locate`, `live_nodes`) fail fast to "nothing known" while Redis is
away: a lookup with ``allow_remote`` is then answered from the local cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from redis.backoff import AbstractBackoff

from kvstore.api.wire import EVENT_TIER_DISK, EVENT_TIER_MEMORY
from kvstore.block import BlockState
from kvstore.events import CacheEvent, EventKind
from kvstore.ops.plural import plural
from kvstore.types import BlockHash, NamespaceId, TenantId
from kvstore.v1 import kvstore_pb2 as pb
from service.cluster import event_stream, redis_link
from service.cluster.directory import Change, Directory, DirectoryQueue, PeerHolder
from service.cluster.engine_sets import EngineEntry, EngineHoldings, EngineSetQueue, EngineSets
from service.cluster.keys import Keys, member
from service.cluster.local import LocalNode
from service.cluster.redis_link import REDIS_ERRORS, backoff_seconds, reconnect_backoff
from service.cluster.registry import NodeInfo, Registry

log = logging.getLogger(__name__)


class DiskHoldings(Protocol):
    """What the agent needs of the node's disk tier (`service.disk.node_tier.NodeDisk`)."""

    def members(self) -> dict[NamespaceId, list[bytes]]:
        """Every block on disk of every registered namespace, as directory members."""


FLUSH_BATCH_BLOCKS = 20_000
"""Most blocks of directory changes in one flush pipeline."""
FLUSH_BATCH_EVENTS = 1_000
"""Most stream entries in one flush pipeline."""


class RedisAgent:
    """Everything one node does on Redis; started and stopped by the server."""

    def __init__(
        self,
        node: LocalNode,
        address: str,
        *,
        connect: Callable[[], Any] | None = None,
        backoff: AbstractBackoff | None = None,
    ) -> None:
        """Prepare the agent; nothing connects until `start`.

        Args:
            node: the node whose store it mirrors.
            address: gRPC address peers fetch from (advertised in the registry).
            connect: client factory (tests may swap the transport).
            backoff: spacing of reconnect attempts.
        """
        config = node.config
        self.node = node
        self.address = address
        self.keys = Keys(config.redis_key_prefix)
        ttl_ms = int(config.node_ttl_seconds * 1000)
        self.directory = Directory(self.keys, node.node_id, ttl_ms)
        self.registry = Registry(self.keys, ttl_ms, config.event_stream_maxlen)
        self.queue = DirectoryQueue(config.directory_queue_blocks)
        self.engine_sets = EngineSets(self.keys, node.node_id, ttl_ms)
        self.disk: DiskHoldings | None = getattr(node, "disk", None)
        """The node's disk tier: its blocks go into the directory's disk sets (docs/disk.md)."""
        self.engines: EngineHoldings | None = getattr(node, "engine_index", None)
        """The node's engine index, mirrored like the directory (docs/events.md)."""
        self.backoff = backoff or reconnect_backoff()
        self._connect = connect or (lambda: redis_link.connect(config))
        self._events: deque[dict[str, bytes]] = deque()
        self._events_limit = config.directory_queue_blocks
        self._events_shed = 0  # dropped from the head since start (see _flush)
        self.events_dropped = 0
        """Stream events dropped while Redis was away, ever."""
        self.connected = False
        """Whether the last Redis command succeeded."""
        self.resyncs = 0
        """Full resyncs done (the first one at start included)."""
        self.client: Any = None
        self._beating: set[NamespaceId] = set()
        """Namespaces whose liveness the last heartbeat (or an early one) wrote."""
        self._synced = asyncio.Event()
        self._wake = asyncio.Event()
        if self.engines is not None:
            self.engines.queue = EngineSetQueue(config.directory_queue_blocks, self._wake.set)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # --- producer side (synchronous, on the loop) -----------------------------

    def publish(self, ev: CacheEvent, at_unix: float, tier: str = EVENT_TIER_MEMORY) -> None:
        """Queue one event of the pool's blocks, or of ``tier``'s, for the directory (the
        disk tier's go to its disk sets) and the stream (`event_stream.fields_of`); never
        blocks."""
        disk = tier == EVENT_TIER_DISK
        if ev.kind is EventKind.STORED:
            self.queue.put(Change.ADD, ev.namespace, ev.scope, ev.hashes, disk=disk)
        elif ev.kind is EventKind.REMOVED:
            self.queue.put(Change.REMOVE, ev.namespace, ev.scope, ev.hashes, disk=disk)
        if len(self._events) >= self._events_limit:
            self._events.popleft()
            self._events_shed += 1
            self.events_dropped += 1
        self._events.append(event_stream.fields_of(ev, self.node.node_id, at_unix, tier))
        self._wake.set()

    # --- life cycle -------------------------------------------------------------

    async def start(self) -> None:
        """Start the background task (Redis may be down: it keeps retrying)."""
        if self._task is not None:
            raise RuntimeError("bug: RedisAgent.start called twice")
        self.client = self._connect()
        self._task = asyncio.create_task(self._run(), name="kvstore-redis-agent")

    async def stop(self, grace: float = 2.0) -> None:
        """Flush what is queued, leave the registry, wipe this node's entries, close."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            # Bounded: a client library that swallowed the cancellation must
            # not hang the node's shutdown.
            done, _ = await asyncio.wait({self._task}, timeout=grace)
            if not done:
                log.warning("the Redis agent did not stop within %.1fs; leaving it", grace)
            self._task = None
        if self.client is None:
            return
        try:
            async with asyncio.timeout(grace):
                await self.registry.leave(self.client, self.node.node_id)
                namespaces = [t.namespace for t in self.node.store.tables()]
                pipe = self.client.pipeline(transaction=False)
                self.directory.wipe(pipe, namespaces)
                await pipe.execute()
                if self.engines is not None:
                    await self.engine_sets.wipe(self.client, namespaces)
        except REDIS_ERRORS as exc:
            log.info("could not leave the registry cleanly (%s); entries expire by TTL", exc)
        finally:
            with contextlib.suppress(TimeoutError, *REDIS_ERRORS):
                async with asyncio.timeout(grace):
                    await redis_link.close(self.client)
            self.client = None

    async def wait_synced(self) -> None:
        """Until the node's entry has been written once (tests, readiness)."""
        await self._synced.wait()

    # --- the loop ---------------------------------------------------------------

    async def _run(self) -> None:
        # Hand-written, not redis-py's Retry: an outage must also buffer, mark a resync and rebuild.
        loop = asyncio.get_running_loop()
        config = self.node.config
        failures = 0
        next_beat = 0.0
        while True:
            try:
                engines_lost = (
                    self.engines is not None
                    and self.engines.queue is not None
                    and (self.engines.queue.needs_resync)
                )
                if self.queue.needs_resync or engines_lost:
                    # Registry first: whatever Redis loses after this beat, the
                    # next one finds this node gone and resyncs again (below).
                    await self._heartbeat()
                    await self._resync()
                    next_beat = loop.time() + config.heartbeat_seconds
                elif loop.time() >= next_beat:
                    if await self._heartbeat():
                        self._lost_entry()
                        next_beat = 0.0  # the resync's own beat comes at once
                    else:
                        next_beat = loop.time() + config.heartbeat_seconds
                await self._beat_new_namespaces()
                await self._flush()
            except REDIS_ERRORS as exc:
                if self.connected or failures == 0:
                    log.warning("Redis unavailable (%s): serving the local cache only", exc)
                self.connected = False
                self._synced.clear()
                self.queue.needs_resync = True
                self.queue.clear()
                self._engines_lost()
                failures += 1
                await asyncio.sleep(backoff_seconds(self.backoff, failures))
                continue
            except Exception:
                log.exception("bug: Redis agent step failed")
                self.queue.needs_resync = True
                self._engines_lost()
                await asyncio.sleep(backoff_seconds(self.backoff, max(failures, 1)))
                continue
            if not self.connected:
                log.info("Redis reachable: directory of node %s in sync", self.node.node_id)
            self.connected = True
            self._synced.set()
            failures = 0
            self.backoff.reset()  # type: ignore[no-untyped-call]  # unannotated in redis-py
            await self._idle(max(0.0, next_beat - loop.time()))

    async def _idle(self, until_beat: float) -> None:
        """Wait for work (or the next heartbeat), then a short while to gather a batch."""
        engine_queue = self.engines.queue if self.engines is not None else None
        if not self._events and not len(self.queue) and not (engine_queue and len(engine_queue)):
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(until_beat):
                    await self._wake.wait()
        if self.queue.blocks < FLUSH_BATCH_BLOCKS and len(self._events) < FLUSH_BATCH_EVENTS:
            await asyncio.sleep(self.node.config.directory_flush_seconds)

    async def _resync(self) -> None:
        """Rewrite this node's whole directory entry from its store."""
        client = self.client
        known = {_text(n) for n in await client.smembers(self.keys.namespaces)}
        # Snapshot and queue reset in one synchronous step: every change after
        # it is queued and flushed after this resync, in order.
        snapshot = self._snapshot()
        on_disk = self.disk.members() if self.disk is not None else None
        self.queue.clear()
        self.queue.needs_resync = False
        engines = self._engine_snapshot()
        pipe = client.pipeline(transaction=False)
        self.directory.wipe(pipe, known | set(snapshot))
        self.directory.write_snapshot(pipe, snapshot, disk=on_disk)
        await pipe.execute()
        if engines is not None:
            await self.engine_sets.wipe(client, known | set(snapshot))
            pipe = client.pipeline(transaction=False)
            self.engine_sets.write_snapshot(pipe, engines)
            await pipe.execute()
        self.resyncs += 1
        log.info(
            "directory resync of node %s: %s in %s",
            self.node.node_id,
            plural(sum(len(m) for m in snapshot.values()), "block"),
            plural(len(snapshot), "namespace"),
        )

    def _lost_entry(self) -> None:
        """A heartbeat found this node's registry entry gone, with no command failing:
        Redis restarted empty within redis-py's silent reconnect (or was flushed), or
        this node stalled past ``node_ttl_seconds``. Its directory entry went the
        same way: rebuild it (issue 40, item 4)."""
        log.warning(
            "node %s was missing from the registry (Redis restarted empty or flushed, "
            "or this node stalled past its TTL): resyncing its directory entry",
            self.node.node_id,
        )
        self.queue.clear()
        self.queue.needs_resync = True
        self._engines_lost()

    def _engines_lost(self) -> None:
        """Changes to engine sets may be lost: drop the queue, rewrite them at the resync."""
        if self.engines is not None and self.engines.queue is not None:
            self.engines.queue.clear()
            self.engines.queue.needs_resync = True

    def _engine_snapshot(self) -> list[EngineEntry] | None:
        """Every engine set, with the engine queue reset in the same synchronous step."""
        if self.engines is None or self.engines.queue is None:
            return None
        self.engines.queue.clear()
        self.engines.queue.needs_resync = False
        return self.engines.entries()

    def _snapshot(self) -> dict[NamespaceId, list[bytes]]:
        """Every READY block of the store as directory members, per namespace."""
        snapshot: dict[NamespaceId, list[bytes]] = {}
        for table in self.node.store.tables():
            members = [
                member(info.hash, info.scope)
                for info in table.iter_blocks()
                if info.state is BlockState.READY
            ]
            snapshot[table.namespace] = members
        return snapshot

    async def _heartbeat(self) -> bool:
        """Beat in the registry and in each namespace; whether this node (re)joined now."""
        node = self.node
        stats = node.store.stats()
        used = sum((ns.ready + ns.writing) * ns.block_bytes for ns in stats.namespaces)
        info = NodeInfo(
            node_id=node.node_id,
            address=self.address,
            devices=("cpu",),
            capacity_bytes=node.pools.capacity_bytes,
            used_bytes=used,
            version=node.version,
            epoch=node.epoch,
        )
        joined, dead = await self.registry.heartbeat(self.client, info)
        if joined:
            log.info("node %s joined the cluster at %s", node.node_id, self.address)
        for other in dead:
            log.info("node %s stopped heartbeating: removed from the registry", other)
        namespaces = [t.namespace for t in node.store.tables()]
        await self.directory.heartbeat(self.client, namespaces, self.address)
        self._beating = set(namespaces)
        if self.engines is not None:
            pipe = self.client.pipeline(transaction=False)
            self.engine_sets.refresh(pipe, self.engines.live_sets())
            await pipe.execute()
        return bool(joined)

    async def _beat_new_namespaces(self) -> None:
        """Write this node's liveness in namespaces registered since the last heartbeat.

        Before their first blocks are flushed: `locate` lists only nodes live in
        the namespace, so until then a peer would find the blocks held by nobody
        (for up to `heartbeat_seconds` after a namespace's registration).
        """
        current = [t.namespace for t in self.node.store.tables()]
        self._beating.intersection_update(current)  # a dropped one may come back
        new = [namespace for namespace in current if namespace not in self._beating]
        if new:
            await self.directory.heartbeat(self.client, new, self.address)
            self._beating.update(new)

    async def _flush(self) -> None:
        """Send queued directory changes and events in one pipeline."""
        changes = self.queue.take(FLUSH_BATCH_BLOCKS)
        queue = self.engines.queue if self.engines is not None else None
        engine_changes = queue.take(FLUSH_BATCH_BLOCKS) if queue is not None else []
        count = min(len(self._events), FLUSH_BATCH_EVENTS)
        if not changes and not count and not engine_changes:
            return
        pipe = self.client.pipeline(transaction=False)
        self.directory.write_changes(pipe, changes)
        self.engine_sets.write_changes(pipe, engine_changes)
        maxlen = self.node.config.event_stream_maxlen
        for i in range(count):
            event_stream.append(pipe, self.keys.events, self._events[i], maxlen)
        shed = self._events_shed
        await pipe.execute()
        # Entries shed from the head while we awaited were among those sent.
        for _ in range(max(0, count - (self._events_shed - shed))):
            self._events.popleft()

    # --- reads ------------------------------------------------------------------

    async def locate(
        self, namespace: NamespaceId, scope: TenantId, chain: list[BlockHash]
    ) -> list[PeerHolder]:
        """Live peers holding a prefix of ``chain``, longest first; [] while Redis is away."""
        if not self.connected or self.client is None:
            return []
        try:
            async with asyncio.timeout(self.node.config.redis_timeout):
                return await self.directory.locate(self.client, namespace, scope, chain)
        except REDIS_ERRORS as exc:
            log.debug("locate failed (%s): answering from the local cache", exc)
            return []

    async def live_nodes(self) -> list[NodeInfo]:
        """The registry's live nodes (raises a Redis error while Redis is away)."""
        return await self.registry.live_nodes(self.client)

    async def watch(self, namespace: str) -> AsyncIterator[pb.Event]:
        """Subscribe to the cluster stream from now (events of ``namespace``, "" = all).

        Starts after the stream's newest entry; while Redis is away it starts
        at whatever arrives once Redis is back (and reads on, with backoff).
        """
        try:
            async with asyncio.timeout(self.node.config.redis_timeout):
                start = await event_stream.last_id(self.client, self.keys.events)
        except REDIS_ERRORS:
            start = b"$"
        # A blocking read must return before the socket timeout counts Redis as down.
        timeout_ms = int(self.node.config.redis_timeout * 500)
        block_ms = max(10, min(event_stream.READ_BLOCK_MS, timeout_ms))
        return event_stream.watch(
            self.client,
            self.keys.events,
            namespace,
            start,
            stopping=lambda: self._stopping,
            block_ms=block_ms,
        )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
