"""Stats, ListBlocks, WatchEvents, Ping and the admin verbs Evict and Clear."""

from __future__ import annotations

from collections.abc import AsyncIterator
from itertools import islice
from typing import Any

from kvstore.errors import FailedPrecondition
from kvstore.v1 import kvstore_pb2 as pb
from service import auth, convert, validate
from service.errors import FieldError, guard_stream_out, guard_unary
from service.servicer_base import ServicerBase


class AdminRpcs(ServicerBase):
    """Inspection and admin RPCs of the KVStore service (admin verbs checked by `service.auth`)."""

    @guard_unary("Stats")
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        """Node-wide occupancy, leases and per-tenant hit accounting."""
        node = self.node
        node.tenant(context)
        stats = node.store.stats()
        namespaces = []
        for ns in stats.namespaces:
            table = node.table(ns.namespace)
            namespaces.append(convert.namespace_stats(ns, table.spec.layout, table.shared))
        return pb.StatsResponse(
            node_id=node.node_id,
            version=node.version,
            pool_kind="host",
            pool_epoch=node.epoch,
            uptime_seconds=node.now() - node.started,
            leases=stats.leases,
            leases_expired=stats.leases_expired,
            pinned=stats.pinned_by_leases,
            writing=stats.writing_by_leases,
            namespaces=namespaces,
            capacity_bytes=node.pools.capacity_bytes,
            allocated_bytes=node.pools.allocated_bytes,
        )

    @guard_unary("ListBlocks")
    async def ListBlocks(
        self, request: pb.ListBlocksRequest, context: Any
    ) -> pb.ListBlocksResponse:
        """One page of a namespace's resident blocks (offset-based page tokens)."""
        node = self.node
        node.tenant(context)
        namespace = self.namespace(request.namespace_id)
        size = validate.page_size(request.page_size)
        offset = validate.page_offset(request.page_token)
        total = len(node.table(namespace))
        page = list(islice(node.store.iter_blocks(namespace), offset, offset + size))
        end = offset + len(page)
        return pb.ListBlocksResponse(
            blocks=[convert.block_info(info, node.to_unix) for info in page],
            next_page_token=validate.page_token(end) if end < total else "",
            total=total,
        )

    @guard_stream_out("WatchEvents")
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: Any
    ) -> AsyncIterator[pb.Event]:
        """Stream this node's cache events until the caller leaves or the node stops.

        Initial metadata is sent once the subscription is in place, so a
        caller that awaits it knows no later event is missed.
        """
        node = self.node
        node.tenant(context)
        namespace = self.namespace(request.namespace_id) if request.namespace_id else ""
        if request.cluster:
            async for event in self._watch_cluster(namespace, context):
                yield event
            return
        watcher = node.events.subscribe(namespace)
        try:
            await context.send_initial_metadata(())
            async for event in watcher:
                yield event
        finally:
            watcher.close()
            if watcher.dropped:
                node.metrics.watch_dropped.inc(watcher.dropped)

    async def _watch_cluster(self, namespace: str, context: Any) -> AsyncIterator[pb.Event]:
        """Every node's events from the Redis stream, from the moment of subscription."""
        agent = self.node.cluster
        if agent is None:
            raise FailedPrecondition(
                "cluster-wide events need Redis, which this node is not configured with"
            )
        events = await agent.watch(namespace)
        await context.send_initial_metadata(())
        async for event in events:
            yield event

    @guard_unary("Ping")
    async def Ping(self, request: pb.PingRequest, context: Any) -> pb.PingResponse:
        """Echo the payload (the benchmarks' baseline)."""
        return pb.PingResponse(payload=request.payload)

    @guard_unary("Evict")
    async def Evict(self, request: pb.EvictRequest, context: Any) -> pb.EvictResponse:
        """Evict up to ``blocks`` unpinned blocks, least recently used first."""
        node = self.node
        node.tenant(context)
        auth.require_admin(context, node.config.admin_token)
        namespace = self.namespace(request.namespace_id)
        if request.blocks == 0:
            raise FieldError("blocks", "must be positive: how many blocks to evict")
        evicted = node.store.evict(namespace, request.blocks, node.now())
        node.publish_events()
        return pb.EvictResponse(evicted=evicted)

    @guard_unary("Clear")
    async def Clear(self, request: pb.ClearRequest, context: Any) -> pb.ClearResponse:
        """Remove every unpinned READY block of a namespace."""
        node = self.node
        node.tenant(context)
        auth.require_admin(context, node.config.admin_token)
        namespace = self.namespace(request.namespace_id)
        report = node.store.clear(namespace, node.now())
        node.publish_events()
        return pb.ClearResponse(
            removed=report.removed,
            kept_pinned=report.kept_pinned,
            kept_writing=report.kept_writing,
        )
