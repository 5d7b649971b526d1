"""What the client knows about its node: the pool epoch, its namespaces and its lease.

`NodeSession` is shared by the client's API (`kvstore.client.client`) and
the byte movers (`kvstore.client.transfer`), so neither reaches into the
other. It keeps the epoch rule: every response with a ``pool_epoch`` is
compared with the epoch the mappings were attached with; a change (the node
restarted) closes every mapping and marks every namespace for
re-registration, and nothing is ever read through a stale mapping.

It also knows, from this process's own clock, until when the node surely
still holds each lease (`lease_alive`): a copy into a reserved slot is made
only while that is true, so a process that stalled past its lease's expiry
never writes a slot the node may have given to another block
(``docs/leases.md``, "Late writers").

A pool that gained or gave back an arena keeps its epoch and changes its
``pool_version`` (carried by Lookup and Reserve answers): `refresh_arenas`
then attaches again and maps only the new arenas (`PoolMapping.refresh`),
so hits taken before stay readable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from kvstore.api.wire import layout_to_proto, scheme_to_proto
from kvstore.client import methods
from kvstore.client.background import Background
from kvstore.client.handles import Namespace
from kvstore.client.lease_keeper import LeaseGrant, LeaseKeeper
from kvstore.client.replies import descriptor_from_proto
from kvstore.client.rpc import Rpc
from kvstore.errors import KVStoreError, LeaseExpired
from kvstore.layout import NamespaceSpec
from kvstore.pool import attach, current_torch_device
from kvstore.types import BlockHash, LeaseId, NamespaceId
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)

LEASE_SAFETY_MARGIN = 1.0
"""Seconds (at most a quarter of the TTL) before its surely-valid-until time at
which a lease stops being used for copies: room for the copy of one block."""


_REGISTERED = ("id", "block_bytes", "capacity", "chain_root", "shared", "verify_loads")
"""The fields of a `Namespace` that RegisterNamespace answers (refreshed in place)."""


class NodeSession:
    """The epoch, namespaces, lease and background tasks of a client of one node."""

    def __init__(
        self, rpc: Rpc, *, lease_ttl: float | None, client_name: str, map_pool: bool
    ) -> None:
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
        self.clock: Callable[[], float] = time.monotonic
        """This process's monotonic clock (the node's, on the same host)."""
        self._valid_until: dict[LeaseId, tuple[float, float]] = {}
        """Per lease: (time before the last confirmed open or renewal was sent) + TTL, and TTL."""

    async def close(self, *, end_lease: bool = True) -> None:
        """Finish cleanups, unmap the pools and end the lease (the channel stays).

        With ``end_lease`` False the lease is only no longer renewed (`LeaseKeeper.close`).

        Unmapped first: a CUDA node frees the arenas it took out of pools once
        the leases that mapped them end (`service.memory.held`).
        """
        await self.background.drain()
        self.drop_mappings()
        await self.lease.close(end_lease=end_lease)

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
            resp = await self.rpc.call(methods.STATS, pb.StatsRequest(), None, idempotent=True)
        except KVStoreError:
            return lost
        return self.observe_epoch(resp.pool_epoch) or lost

    # --- leases -----------------------------------------------------------------------

    def lease_alive(self, lease_id: LeaseId) -> None:
        """Raise `LeaseExpired` unless the node surely still holds ``lease_id``.

        "Surely": the node set the lease's deadline to its own ``now + ttl``
        when it answered the last open or renewal, and its ``now`` was no
        earlier than our clock when we sent that call; a safety margin is
        kept for the copy about to start. Called before every block copy
        into a reserved slot: a process that stalled (suspended, swapped,
        stuck in a long synchronous call while the keeper could not renew)
        wakes up here and refuses, instead of writing a slot the node has
        taken back.
        """
        valid = self._valid_until.get(lease_id)
        now = self.clock()
        if valid is None:
            raise LeaseExpired(f"lease {lease_id:x} was never confirmed by this client")
        until, ttl = valid
        margin = min(LEASE_SAFETY_MARGIN, ttl / 4)
        if now >= until - margin:
            raise LeaseExpired(
                f"lease {lease_id:x} is not surely live: {until - now:.3f}s of it left by this "
                f"process's clock, under the {margin:.3f}s safety margin (the process stalled "
                "or renewals failed); nothing was written, store again"
            )

    def surely_until(self, lease_id: LeaseId) -> float:
        """This host's monotonic time until which the node surely still holds ``lease_id``.

        The `lease_alive` rule as a deadline (safety margin included), for a
        reader in another process of this host (``time.monotonic`` is one clock
        for every process): 0.0 when this client never confirmed the lease.
        """
        valid = self._valid_until.get(lease_id)
        if valid is None:
            return 0.0
        until, ttl = valid
        return until - min(LEASE_SAFETY_MARGIN, ttl / 4)

    async def refresh_lease(self, lease_id: LeaseId) -> None:
        """Renew ``lease_id`` now if less than half its TTL is surely left.

        Called before copying into slots reserved under it, so that a lease
        whose keeper fell behind (the event loop was busy) is not refused by
        `lease_alive` while the node still holds it.
        """
        valid = self._valid_until.get(lease_id)
        if valid is None or self.lease.lease_id != lease_id:
            return  # gone or replaced: `lease_alive` refuses the copy
        until, ttl = valid
        if until - self.clock() < ttl / 2:
            with contextlib.suppress(KVStoreError):  # unreachable: `lease_alive` decides
                await self.lease.renew_now()

    def _confirmed(self, lease_id: LeaseId, sent: float, ttl: float) -> None:
        now = self.clock()
        # Forget leases surely over (replaced ones); keep this one's latest answer.
        for old in [k for k, (until, _) in self._valid_until.items() if until <= now]:
            del self._valid_until[old]
        self._valid_until[lease_id] = (sent + ttl, ttl)

    async def _open_lease(self) -> LeaseGrant:
        # ttl 0 asks for the node's default (its lease_ttl_default).
        req = pb.OpenLeaseRequest(
            ttl_seconds=self.lease_ttl or 0.0,
            client_name=self.client_name,
            pool_versions=self.pool_versions(),
        )
        sent = self.clock()
        resp = await self.rpc.call(methods.OPEN_LEASE, req, None, idempotent=False)
        self.observe_epoch(resp.pool_epoch)
        grant = LeaseGrant(LeaseId(resp.lease_id), resp.ttl_seconds or self.lease_ttl or 0.0)
        self._confirmed(grant.lease_id, sent, grant.ttl)
        return grant

    async def _renew_lease(self, lease_id: LeaseId) -> float:
        sent = self.clock()
        resp = await self.rpc.call(
            methods.KEEP_ALIVE,
            pb.KeepAliveRequest(lease_id=lease_id, pool_versions=self.pool_versions()),
            None,
            idempotent=True,
        )
        self.observe_epoch(resp.pool_epoch)
        ttl = float(resp.ttl_seconds)
        self._confirmed(lease_id, sent, ttl)
        return ttl

    def pool_versions(self) -> list[pb.PoolVersion]:
        """The pool version of each namespace mapped here (sent with the lease).

        A CUDA node keeps an arena it took out of a pool until no lease reports
        an older version of that namespace (`service.memory.held`).
        """
        versions = []
        for ns in self._namespaces.values():
            mapping = ns.mapping
            if mapping is not None and not mapping.closed:
                versions.append(
                    pb.PoolVersion(namespace_id=ns.id, version=mapping.descriptor.version)
                )
        return versions

    def _attach_request(self, ns: Namespace) -> pb.AttachPoolRequest:
        """An AttachPool under the current lease, naming what this process maps of ``ns`` now."""
        mapping = ns.mapping
        mapped = mapping.descriptor.version if mapping is not None and not mapping.closed else 0
        return pb.AttachPoolRequest(
            namespace_id=ns.id, lease_id=self.lease.lease_id or 0, mapped_version=mapped
        )

    async def _close_lease(self, lease_id: LeaseId) -> None:
        await self.rpc.call(
            methods.CLOSE_LEASE, pb.CloseLeaseRequest(lease_id=lease_id), 2.0, idempotent=False
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
        resp = await self.rpc.call(methods.REGISTER_NAMESPACE, req, timeout, idempotent=True)
        fresh = Namespace(
            spec=spec,
            id=NamespaceId(resp.namespace_id),
            block_bytes=resp.block_bytes or spec.layout.block_bytes,
            capacity=resp.capacity_blocks,
            chain_root=BlockHash(resp.chain_root),
            shared=resp.shared,
            verify_loads=resp.verify_local_loads,
        )
        ns = self._namespaces.get(spec)
        if ns is None:
            ns = self._namespaces[spec] = fresh
        else:  # refresh in place: the runner's handle stays valid across restarts
            for name in _REGISTERED:
                setattr(ns, name, getattr(fresh, name))
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
            methods.ATTACH_POOL, self._attach_request(ns), timeout, idempotent=True
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

    async def follow_epoch(self, ns: Namespace, epoch: int, timeout: float | None) -> None:
        """Remap ``ns`` when another process's lookup saw the node at another pool ``epoch``.

        For a process that reads slots another process looked up (the vLLM
        worker, with its scheduler's `Hit.epoch`): a node restart is seen by
        the process whose call meets it; this one asks the node for its epoch
        (Stats), and after a change registers ``ns`` again and maps the new
        pool. The caller checks ``ns.epoch`` afterwards: it may still differ
        (the node restarted again since that lookup), and then the lookup's
        slots must not be read.
        """
        if ns.epoch == epoch:
            return
        resp = await self.rpc.call(methods.STATS, pb.StatsRequest(), timeout, idempotent=True)
        self.observe_epoch(resp.pool_epoch)
        await self.ensure_ready(ns, timeout)

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
            methods.ATTACH_POOL, self._attach_request(ns), timeout, idempotent=True
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
