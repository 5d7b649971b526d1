"""What the client knows about its node: the pool epoch, its namespaces and its lease.

`NodeSession` is shared by the client's API (`kvstore.client.client`) and
the byte movers (`kvstore.client.transfer`), so neither reaches into the
other. It keeps the epoch rule: every response with a ``pool_epoch`` is
compared with the epoch the mappings were attached with; a change (the node
restarted) closes every mapping and marks every namespace for
re-registration, and nothing is ever read through a stale mapping.

A pool that gained or gave back an arena keeps its epoch and changes its
``pool_version`` (carried by Lookup and Reserve answers): `refresh_arenas`
then attaches again and maps only the new arenas (`PoolMapping.refresh`),
so hits taken before stay readable.
"""

from __future__ import annotations

import asyncio
import logging

from kvstore.api.wire import layout_to_proto, scheme_to_proto
from kvstore.client.background import Background
from kvstore.client.convert import descriptor_from_proto
from kvstore.client.handles import Namespace
from kvstore.client.lease import LeaseGrant, LeaseKeeper
from kvstore.client.rpc import Rpc
from kvstore.errors import KVStoreError
from kvstore.layout import NamespaceSpec
from kvstore.pool import attach, current_torch_device
from kvstore.types import BlockHash, LeaseId, NamespaceId
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)


class NodeSession:
    """The epoch, namespaces, lease and background tasks of a client of one node."""

    def __init__(self, rpc: Rpc, *, lease_ttl: float, client_name: str, map_pool: bool) -> None:
        """Wrap a transport; see `Client` for the arguments."""
        self.rpc = rpc
        self.lease_ttl = lease_ttl
        self.client_name = client_name
        self.map_pool = map_pool
        """Map namespace pools into this process (same host only)."""
        self.background = Background()
        self.lease = LeaseKeeper(self._open_lease, self._renew_lease, self._close_lease)
        self.epoch: int | None = None
        """The node's pool epoch as last seen, None before the first answer carrying it."""
        self._namespaces: dict[NamespaceSpec, Namespace] = {}

    async def close(self) -> None:
        """Finish cleanups, end the lease and unmap the pools (the channel stays)."""
        await self.background.drain()
        await self.lease.close()
        self.drop_mappings()

    # --- epochs -------------------------------------------------------------------------

    def observe_epoch(self, epoch: int) -> bool:
        """Record the node's epoch; on a change drop every mapping. True if it changed."""
        if epoch == 0 or epoch == self.epoch:
            return False
        old, self.epoch = self.epoch, epoch
        if old is None:
            return False
        log.warning("pool epoch changed %x -> %x: the node restarted; remapping", old, epoch)
        self.drop_mappings()
        for ns in self._namespaces.values():
            ns.stale = True  # the restarted node may not know it, or hand out another root
        return True

    def drop_mappings(self) -> None:
        """Close every pool mapping (they are made again on next use)."""
        for ns in self._namespaces.values():
            if ns.mapping is not None:
                ns.mapping.close()
                ns.mapping = None

    async def recover(self, lease_used: bool) -> bool:
        """After NOT_FOUND / FAILED_PRECONDITION: True when the node restarted or the lease
        was lost (the caller then retries once), False when the error stands."""
        lost = lease_used and not await self.lease.renew_now()
        try:
            resp = await self.rpc.call("Stats", pb.StatsRequest(), None, idempotent=True)
        except KVStoreError:
            return lost
        return self.observe_epoch(resp.pool_epoch) or lost

    # --- leases -----------------------------------------------------------------------

    async def _open_lease(self) -> LeaseGrant:
        req = pb.OpenLeaseRequest(ttl_seconds=self.lease_ttl, client_name=self.client_name)
        resp = await self.rpc.call("OpenLease", req, None, idempotent=False)
        self.observe_epoch(resp.pool_epoch)
        return LeaseGrant(LeaseId(resp.lease_id), resp.ttl_seconds or self.lease_ttl)

    async def _renew_lease(self, lease_id: LeaseId) -> float:
        resp = await self.rpc.call(
            "KeepAlive", pb.KeepAliveRequest(lease_id=lease_id), None, idempotent=True
        )
        self.observe_epoch(resp.pool_epoch)
        return float(resp.ttl_seconds)

    async def _close_lease(self, lease_id: LeaseId) -> None:
        await self.rpc.call(
            "CloseLease", pb.CloseLeaseRequest(lease_id=lease_id), 2.0, idempotent=False
        )

    # --- namespaces ---------------------------------------------------------------------

    def namespace(self, spec: NamespaceSpec) -> Namespace | None:
        """The namespace registered for ``spec``, if any."""
        return self._namespaces.get(spec)

    async def register(
        self,
        spec: NamespaceSpec,
        capacity_bytes: int,
        timeout: float | None,
    ) -> Namespace:
        """Register ``spec`` with the node; a known namespace is refreshed in place."""
        req = pb.RegisterNamespaceRequest(
            model_id=spec.model_id,
            layout=layout_to_proto(spec.layout),
            scheme=scheme_to_proto(spec.scheme),
            vllm_seed=spec.vllm_seed,
            capacity_bytes=capacity_bytes,
        )
        resp = await self.rpc.call("RegisterNamespace", req, timeout, idempotent=True)
        ns = self._namespaces.get(spec)
        fields = {
            "id": NamespaceId(resp.namespace_id),
            "block_bytes": resp.block_bytes or spec.layout.block_bytes,
            "capacity": resp.capacity_blocks,
            "chain_root": BlockHash(resp.chain_root),
            "shared": resp.shared,
        }
        if ns is None:
            ns = self._namespaces[spec] = Namespace(spec=spec, **fields)
        else:  # refresh in place: the runner's handle stays valid across restarts
            for name, value in fields.items():
                setattr(ns, name, value)
        ns.stale = False
        return ns

    async def refresh_arenas(self, ns: Namespace, version: int, timeout: float | None) -> None:
        """Follow the pool's arena set when an answer names another ``version``.

        Host pools are refreshed in place; a kind that cannot (CUDA) is
        attached anew, which ends the hits made with the old mapping.
        """
        mapping = ns.mapping
        if not version or mapping is None or mapping.closed:
            return
        if mapping.descriptor.version == version:
            return
        resp = await self.rpc.call(
            "AttachPool", pb.AttachPoolRequest(namespace_id=ns.id), timeout, idempotent=True
        )
        descriptor = descriptor_from_proto(resp)
        if self.observe_epoch(descriptor.epoch) or ns.mapping is not mapping or mapping.closed:
            return  # restarted, or remapped meanwhile: the epoch rule takes over
        if descriptor.version == mapping.descriptor.version:
            return
        if await asyncio.to_thread(mapping.refresh, descriptor):
            return
        device = current_torch_device() if descriptor.kind == "cuda" else None
        mapping.close()
        ns.mapping = await asyncio.to_thread(attach, descriptor, device=device)

    async def ensure_ready(
        self,
        ns: Namespace,
        timeout: float | None,
    ) -> None:
        """Re-register after an epoch change and (re)map the pool if needed."""
        if ns.stale:
            await self.register(ns.spec, 0, timeout)
        if not self.map_pool or (ns.mapping is not None and not ns.mapping.closed):
            return
        resp = await self.rpc.call(
            "AttachPool", pb.AttachPoolRequest(namespace_id=ns.id), timeout, idempotent=True
        )
        descriptor = descriptor_from_proto(resp)
        if self.observe_epoch(descriptor.epoch):
            await self.register(ns.spec, 0, timeout)
        # Mapping a large pool pre-faults its pages: keep the event loop free meanwhile.
        # The runner's GPU is read here: the worker thread's current device would be 0.
        device = current_torch_device() if descriptor.kind == "cuda" else None
        mapping = await asyncio.to_thread(attach, descriptor, device=device)
        if ns.mapping is not None:
            ns.mapping.close()
        ns.mapping = mapping
