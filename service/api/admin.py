"""Stats, ListBlocks, WatchEvents, Ping and the admin verbs Evict, Clear and DropNamespace."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from itertools import islice
from typing import Any

from kvstore.errors import FailedPrecondition, UnknownNamespace
from kvstore.results import NamespaceStats
from kvstore.types import SHARED_SCOPE, NamespaceId, TenantId
from kvstore.v1 import kvstore_pb2 as pb
from service.api import translate, validate
from service.api.base import ServicerBase
from service.api.errors import FieldError, guard_stream_out, guard_unary
from service.tenancy.callers import Caller


class AdminRpcs(ServicerBase):
    """Inspection and admin RPCs of the KVStore service (admin rule: `service.tenancy.auth`).

    With auth on, a tenant's inspection is confined to itself: Stats lists
    only the namespaces it may use and only its own counters, ListBlocks
    only its own scope's blocks, WatchEvents only its own scope's events
    (never another tenant's hashes). The admin, and everyone with auth off,
    sees everything.
    """

    def _visible_stats(self, caller: Caller, ns: NamespaceStats) -> NamespaceStats | None:
        """``ns`` as ``caller`` may see it, or None when the namespace is not theirs."""
        if caller.sees_all:
            return ns
        table = self.node.table(ns.namespace)
        if caller.policy is None or not caller.policy.may_use(table.spec.model_id):
            return None
        mine = {caller.tenant, table.scope_of(caller.tenant)}
        return replace(
            ns,
            tenants={t: c for t, c in ns.tenants.items() if t in mine},
            resident_by_tenant={t: n for t, n in ns.resident_by_tenant.items() if t in mine},
        )

    def _event_filter(self, caller: Caller) -> Callable[[pb.Event], bool] | None:
        """What events ``caller`` may watch: its own scope's, and ones naming no blocks."""
        if caller.sees_all:
            return None
        node = self.node
        policy = caller.policy
        mine = {caller.tenant, SHARED_SCOPE}

        def visible(event: pb.Event) -> bool:
            if not event.hashes and not event.parent:
                return True  # node joined/left, namespace cleared: no tenant data
            if TenantId(event.tenant) not in mine or policy is None:
                return False
            try:
                model_id = node.table(NamespaceId(event.namespace_id)).spec.model_id
            except UnknownNamespace:  # another node's namespace: not provably theirs
                return False
            return policy.may_use(model_id)

        return visible

    @guard_unary("Stats")
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        """Node-wide occupancy, leases and per-tenant hit accounting."""
        node = self.node
        caller = node.caller(context)
        return node.stats_response(lambda ns: self._visible_stats(caller, ns))

    @guard_unary("ListBlocks")
    async def ListBlocks(
        self, request: pb.ListBlocksRequest, context: Any
    ) -> pb.ListBlocksResponse:
        """One page of a namespace's resident blocks (offset-based page tokens)."""
        node = self.node
        caller = node.caller(context)
        tenant = None if caller.sees_all else caller.tenant
        namespace = self.namespace(request.namespace_id, tenant)
        size = validate.page_size(request.page_size)
        offset = validate.page_offset(request.page_token)
        table = node.table(namespace)
        scope = None if tenant is None else table.scope_of(tenant)
        total = table.resident(scope)
        page = list(islice(table.iter_blocks(scope), offset, offset + size))
        end = offset + len(page)
        index = node.engine_index
        return pb.ListBlocksResponse(
            blocks=[
                translate.block_info(
                    info,
                    node.to_unix,
                    index.holders(namespace, info.scope, info.hash) if index is not None else (),
                )
                for info in page
            ],
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
        caller = node.caller(context)
        tenant = None if caller.sees_all else caller.tenant
        namespace = self.namespace(request.namespace_id, tenant) if request.namespace_id else ""
        visible = self._event_filter(caller)
        if request.cluster:
            async for event in self._watch_cluster(namespace, context):
                if visible is None or visible(event):
                    yield event
            return
        watcher = node.events.subscribe(namespace, visible)
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
        node.require_admin(context)
        namespace = self.namespace(request.namespace_id, None)
        if request.blocks == 0:
            raise FieldError("blocks", "must be positive: how many blocks to evict")
        evicted = node.store.evict(namespace, request.blocks, node.now())
        node.publish_events()
        return pb.EvictResponse(evicted=evicted)

    @guard_unary("Clear")
    async def Clear(self, request: pb.ClearRequest, context: Any) -> pb.ClearResponse:
        """Remove every unpinned READY block of a namespace."""
        node = self.node
        node.require_admin(context)
        namespace = self.namespace(request.namespace_id, None)
        report = node.store.clear(namespace, node.now())
        node.publish_events()
        return pb.ClearResponse(
            removed=report.removed,
            kept_pinned=report.kept_pinned,
            kept_writing=report.kept_writing,
        )

    @guard_unary("DropNamespace")
    async def DropNamespace(
        self, request: pb.DropNamespaceRequest, context: Any
    ) -> pb.DropNamespaceResponse:
        """Remove a namespace and its pool (FAILED_PRECONDITION while in use, unless force)."""
        node = self.node
        node.require_admin(context)
        namespace = self.namespace(request.namespace_id, None)
        report, freed = await node.drop(namespace, request.force)
        return pb.DropNamespaceResponse(
            removed=report.removed,
            pins_dropped=report.pins_dropped,
            writes_aborted=report.writes_aborted,
            freed_bytes=freed,
        )
