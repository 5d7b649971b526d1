"""The async client that model runners use: control over gRPC, bytes in place.

    async with Client("127.0.0.1:50051", tenant="acme") as kv:
        ns = await kv.register_namespace("my-model", layout)
        hit = await kv.lookup(ns, tokens, pin=True)
        ...use hit.torch_views()...
        await kv.release(hit)
        await kv.store(ns, tokens, blocks)

Rules the client keeps:

* Every call takes ``timeout`` (default: the client's); retries go through
  one `RetryPolicy` and only for idempotent calls.
* **Epochs.** Every response with a ``pool_epoch`` is compared with the epoch
  the mappings were attached with. A change (the node restarted) closes every
  mapping and marks every namespace for re-registration; a lookup is redone
  once transparently; nothing is ever read through a stale mapping.
* **Nothing leaks on cancellation.** A pinned lookup or a reservation that is
  cancelled mid-flight is finished in the background and its pins released
  or its slots aborted; a failing or cancelled `store` aborts what it
  reserved (``except BaseException: abort; raise``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine, Sequence
from types import TracebackType
from typing import Any

import grpc

from kvstore.api.wire import layout_to_proto, scheme_to_proto
from kvstore.client.blocks import BlockSupplier
from kvstore.client.convert import (
    chain_fields,
    descriptor_from_proto,
    hit_from_proto,
)
from kvstore.client.errors import PoolEpochChanged, error_from_rpc
from kvstore.client.handles import Hit, Namespace, StoreResult
from kvstore.client.lease import LeaseGrant, LeaseKeeper
from kvstore.client.retry import RetryPolicy
from kvstore.client.tls import Pem, TLSOptions
from kvstore.client.transfer import read_hit, store_chain
from kvstore.errors import FailedPrecondition, KVStoreError, NotFound
from kvstore.hashing import Extra, HashScheme, Tokens
from kvstore.layout import KVLayout, NamespaceSpec
from kvstore.pool import attach, current_torch_device
from kvstore.types import BlockHash, LeaseId, NamespaceId
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc

log = logging.getLogger(__name__)

TENANT_HEADER = "x-kvstore-tenant"
"""Metadata key naming the caller's tenant."""


class Client:
    """Async gRPC client of one cache node; owns its channel, lease and mappings."""

    def __init__(
        self,
        target: str,
        *,
        tenant: str | None = None,
        token: str | None = None,
        lease_ttl: float = 30.0,
        timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        map_pool: bool = True,
        client_name: str = "",
        channel_options: Sequence[tuple[str, Any]] = (),
        tls: bool | TLSOptions = False,
        tls_root_cert: Pem | None = None,
    ) -> None:
        """Configure a client; the channel opens in `connect` (or ``async with``).

        Args:
            target: ``host:port`` of the node.
            tenant: sent as ``x-kvstore-tenant`` when given.
            token: sent as ``authorization: Bearer <token>`` when given.
            lease_ttl: TTL asked for the client's lease, in seconds.
            timeout: default deadline of every call, in seconds.
            retry: retry policy of idempotent calls.
            map_pool: map namespace pools into this process (same host only).
            client_name: shown by ops tools next to the lease.
            channel_options: extra ``grpc.aio`` channel options.
            tls: connect over TLS; True verifies the node against the system
                roots (or ``tls_root_cert``), a `TLSOptions` adds a client
                certificate for mutual TLS.
            tls_root_cert: CA bundle (PEM bytes or a file path) the node's
                certificate must chain to; implies ``tls``.
        """
        self.target = target
        self.timeout = timeout
        self.lease_ttl = lease_ttl
        self.map_pool = map_pool
        self.client_name = client_name
        self._retry = retry or RetryPolicy()
        self._options = list(channel_options)
        self._tls: TLSOptions | None = None
        if isinstance(tls, TLSOptions):
            self._tls = tls
        elif tls or tls_root_cert is not None:
            self._tls = TLSOptions(root_cert=tls_root_cert)
        metadata: list[tuple[str, str]] = []
        if tenant:
            metadata.append((TENANT_HEADER, tenant))
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        self._metadata = tuple(metadata)
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._epoch: int | None = None
        self._namespaces: dict[NamespaceSpec, Namespace] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._lease = LeaseKeeper(self._open_lease, self._renew_lease, self._close_lease)

    # --- life cycle ----------------------------------------------------------------

    async def connect(self) -> None:
        """Open the channel (idempotent); the lease opens on first need."""
        if self._channel is None:
            if self._tls is None:
                self._channel = grpc.aio.insecure_channel(self.target, options=self._options)
            else:
                credentials = self._tls.credentials()
                self._channel = grpc.aio.secure_channel(self.target, credentials, self._options)
            self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)

    async def close(self) -> None:
        """Finish cleanups, end the lease, unmap the pools and close the channel."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._lease.close()
        self._drop_mappings()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def epoch(self) -> int | None:
        """The node's pool epoch as last seen, None before the first answer carrying it."""
        return self._epoch

    @property
    def lease(self) -> LeaseKeeper:
        """The client's lease keeper (its id, generation and losses)."""
        return self._lease

    # --- plumbing ---------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        request: Any,
        timeout: float | None,
        *,
        idempotent: bool,
    ) -> Any:
        if self._stub is None:
            raise FailedPrecondition("the client is not connected; use `async with Client(...)`")
        stub_method = getattr(self._stub, method)
        deadline = self.timeout if timeout is None else timeout

        async def attempt(remaining: float | None) -> Any:
            return await stub_method(request, timeout=remaining, metadata=self._metadata)

        try:
            if idempotent:
                return await self._retry.call(attempt, deadline)
            return await attempt(deadline)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err

    def _observe_epoch(self, epoch: int) -> bool:
        """Record the node's epoch; on a change drop every mapping. True if it changed."""
        if epoch == 0 or epoch == self._epoch:
            return False
        old, self._epoch = self._epoch, epoch
        if old is None:
            return False
        log.warning("pool epoch changed %x -> %x: the node restarted; remapping", old, epoch)
        self._drop_mappings()
        for ns in self._namespaces.values():
            ns.stale = True  # the restarted node may not know it, or hand out another root
        return True

    def _drop_mappings(self) -> None:
        for ns in self._namespaces.values():
            if ns.mapping is not None:
                ns.mapping.close()
                ns.mapping = None

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _cleanup(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a cleanup to its end even if the caller is cancelled again meanwhile."""
        await asyncio.shield(self._spawn(coro))

    async def _quietly(self, what: str, call: Awaitable[Any]) -> None:
        try:
            await call
        except KVStoreError as exc:  # the lease drops it anyway when it ends
            log.warning("%s failed (the lease will drop it): %s", what, exc)

    # --- leases -----------------------------------------------------------------------

    async def _open_lease(self) -> LeaseGrant:
        req = pb.OpenLeaseRequest(ttl_seconds=self.lease_ttl, client_name=self.client_name)
        resp = await self._call("OpenLease", req, None, idempotent=False)
        self._observe_epoch(resp.pool_epoch)
        return LeaseGrant(LeaseId(resp.lease_id), resp.ttl_seconds or self.lease_ttl)

    async def _renew_lease(self, lease_id: LeaseId) -> float:
        resp = await self._call(
            "KeepAlive", pb.KeepAliveRequest(lease_id=lease_id), None, idempotent=True
        )
        self._observe_epoch(resp.pool_epoch)
        return float(resp.ttl_seconds)

    async def _close_lease(self, lease_id: LeaseId) -> None:
        await self._call(
            "CloseLease", pb.CloseLeaseRequest(lease_id=lease_id), 2.0, idempotent=False
        )

    # --- namespaces ---------------------------------------------------------------------

    async def register_namespace(
        self,
        model_id: str,
        layout: KVLayout,
        *,
        scheme: HashScheme = HashScheme.KVSTORE_SHA256,
        vllm_seed: str = "",
        capacity_bytes: int = 0,
        timeout: float | None = None,
    ) -> Namespace:
        """Register (idempotently) a namespace and map its pool; cached per spec.

        Raises:
            AlreadyExists: the model is registered with another layout.
        """
        spec = NamespaceSpec(model_id, layout, scheme, vllm_seed)
        ns = self._namespaces.get(spec)
        if ns is None or ns.stale:
            ns = await self._register(spec, capacity_bytes, timeout)
        await self._ensure_ready(ns, timeout)
        return ns

    async def _register(
        self,
        spec: NamespaceSpec,
        capacity_bytes: int,
        timeout: float | None,
    ) -> Namespace:
        req = pb.RegisterNamespaceRequest(
            model_id=spec.model_id,
            layout=layout_to_proto(spec.layout),
            scheme=scheme_to_proto(spec.scheme),
            vllm_seed=spec.vllm_seed,
            capacity_bytes=capacity_bytes,
        )
        resp = await self._call("RegisterNamespace", req, timeout, idempotent=True)
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

    async def _ensure_ready(
        self,
        ns: Namespace,
        timeout: float | None,
    ) -> None:
        """Re-register after an epoch change and (re)map the pool if needed."""
        if ns.stale:
            await self._register(ns.spec, 0, timeout)
        if not self.map_pool or (ns.mapping is not None and not ns.mapping.closed):
            return
        resp = await self._call(
            "AttachPool", pb.AttachPoolRequest(namespace_id=ns.id), timeout, idempotent=True
        )
        descriptor = descriptor_from_proto(resp)
        if self._observe_epoch(descriptor.epoch):
            await self._register(ns.spec, 0, timeout)
        # Mapping a large pool pre-faults its pages: keep the event loop free meanwhile.
        # The runner's GPU is read here: the worker thread's current device would be 0.
        device = current_torch_device() if descriptor.kind == "cuda" else None
        mapping = await asyncio.to_thread(attach, descriptor, device=device)
        if ns.mapping is not None:
            ns.mapping.close()
        ns.mapping = mapping

    # --- lookups --------------------------------------------------------------------------

    async def lookup(
        self,
        ns: Namespace,
        tokens: Tokens | None = None,
        *,
        hashes: Sequence[bytes] | None = None,
        extras: Sequence[Extra] | None = None,
        pin: bool = False,
        timeout: float | None = None,
    ) -> Hit:
        """The longest cached prefix of a chain, pinned under the client's lease if ``pin``.

        Redone once, transparently, when the node restarted (epoch change or
        lost lease). Release a pinned hit with `release`.
        """
        fields = chain_fields(tokens, hashes, extras)
        for attempt in (0, 1):
            await self._ensure_ready(ns, timeout)
            lease_id, generation = await self._lease.current() if pin else (LeaseId(0), 0)
            req = pb.LookupRequest(namespace_id=ns.id, lease_id=lease_id, pin=pin, **fields)
            try:
                resp = await self._guarded_lookup(ns, req, timeout)
            except (NotFound, FailedPrecondition):
                if attempt == 0 and await self._recover(pin):
                    continue
                raise
            hit = hit_from_proto(ns, resp, generation)
            changed = self._observe_epoch(resp.pool_epoch)
            if changed or (self.map_pool and hit.epoch and hit.epoch != ns.epoch):
                if hit.pinned:
                    await self._cleanup(self._quietly("release", self._send_release(hit)))
                if attempt == 0:
                    continue
                raise PoolEpochChanged("the node restarted twice during one lookup", new=hit.epoch)
            return hit
        raise AssertionError("bug: unreachable")

    async def _guarded_lookup(
        self,
        ns: Namespace,
        req: pb.LookupRequest,
        timeout: float | None,
    ) -> Any:
        if not req.pin:
            return await self._call("Lookup", req, timeout, idempotent=True)
        call = self._spawn_call(self._call("Lookup", req, timeout, idempotent=False))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            # The node may pin before we stop listening: release what it pinned.
            self._spawn(self._release_when_done(ns, LeaseId(req.lease_id), call))
            raise

    def _spawn_call(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        return asyncio.ensure_future(coro)

    async def _release_when_done(
        self, ns: Namespace, lease_id: LeaseId, call: asyncio.Future[Any]
    ) -> None:
        try:
            resp = await call
        except KVStoreError:
            return
        if resp.pinned and resp.blocks:
            # Under the lease that pinned them: if it was replaced meanwhile,
            # the new lease's pins of the same blocks are not ours to drop.
            req = pb.ReleaseRequest(
                namespace_id=ns.id,
                lease_id=lease_id,
                hashes=[b.hash for b in resp.blocks],
            )
            await self._quietly("release", self._call("Release", req, None, idempotent=False))

    async def _recover(self, lease_used: bool) -> bool:
        """After NOT_FOUND / FAILED_PRECONDITION: True when the node restarted or the lease
        was lost (the caller then retries once), False when the error stands."""
        lost = lease_used and not await self._lease.renew_now()
        try:
            resp = await self._call("Stats", pb.StatsRequest(), None, idempotent=True)
        except KVStoreError:
            return lost
        return self._observe_epoch(resp.pool_epoch) or lost

    async def release(
        self,
        hit: Hit,
        *,
        timeout: float | None = None,
    ) -> int:
        """Drop the pins of a hit; a second release (or of an unpinned hit) sends nothing.

        Returns:
            Pins the node released.
        """
        if not hit.pinned or hit.released or not hit.blocks:
            hit.released = True
            return 0
        hit.released = True
        if hit.lease_generation != self._lease.generation:
            return 0  # that lease is gone, and its pins with it
        try:
            return await self._send_release(hit, timeout)
        except BaseException:
            hit.released = False  # let the caller try again
            raise

    async def _send_release(
        self,
        hit: Hit,
        timeout: float | None = None,
    ) -> int:
        lease_id = self._lease.lease_id
        if lease_id is None:
            return 0
        req = pb.ReleaseRequest(namespace_id=hit.namespace.id, lease_id=lease_id, hashes=hit.hashes)
        resp = await self._call("Release", req, timeout, idempotent=False)
        return int(resp.released)

    # --- writes and data ----------------------------------------------------------------

    async def store(
        self,
        ns: Namespace,
        tokens: Tokens | None = None,
        blocks: BlockSupplier = (),
        *,
        hashes: Sequence[bytes] | None = None,
        extras: Sequence[Extra] | None = None,
        timeout: float | None = None,
    ) -> StoreResult:
        """Store the missing blocks of a chain: Reserve, copy in, Commit.

        Args:
            ns: the namespace.
            tokens: the prompt (full blocks only are stored); or ``hashes``.
            blocks: one block per full block of the chain (bytes, arrays or
                tensors of ``block_bytes`` each), or a callable ``i -> block``
                called only for the blocks this call must write.
            hashes: precomputed chain hashes instead of tokens.
            extras: per-block extra hash input (bytes).
            timeout: deadline of each RPC.

        On any exception or cancellation, every block this call reserved is
        aborted before the error propagates.
        """
        return await store_chain(self, ns, chain_fields(tokens, hashes, extras), blocks, timeout)

    async def read_blocks(
        self,
        hit: Hit,
        *,
        timeout: float | None = None,
    ) -> list[bytes]:
        """The bytes of a pinned hit's blocks over gRPC (for runners that cannot map the pool)."""
        return await read_hit(self, hit, timeout)

    async def stats(
        self,
        *,
        timeout: float | None = None,
    ) -> pb.StatsResponse:
        """Node-wide statistics (the raw StatsResponse)."""
        resp: pb.StatsResponse = await self._call(
            "Stats", pb.StatsRequest(), timeout, idempotent=True
        )
        self._observe_epoch(resp.pool_epoch)
        return resp

    async def ping(
        self,
        payload: bytes = b"",
        *,
        timeout: float | None = None,
    ) -> bytes:
        """Echo ``payload`` through the node (the baseline round trip)."""
        resp = await self._call("Ping", pb.PingRequest(payload=payload), timeout, idempotent=True)
        return bytes(resp.payload)
