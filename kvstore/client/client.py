"""The async client that model runners use: control over gRPC, bytes in place.

    async with Client("127.0.0.1:50051", tenant="acme") as kv:
        ns = await kv.register_namespace("my-model", layout)
        hit = await kv.lookup(ns, tokens, pin=True)
        ...use hit.torch_views()...
        await kv.release(hit)   # after the GPU reads of the views (see `release`)
        await kv.store(ns, tokens, blocks)

Rules the client keeps:

* Every call takes ``timeout`` (default: the client's); retries go through
  one `RetryPolicy` and only for idempotent calls.
* **Epochs.** Every response with a ``pool_epoch`` is compared with the epoch
  the mappings were attached with. A change (the node restarted) closes every
  mapping and marks every namespace for re-registration; a lookup is redone
  once transparently; nothing is ever read through a stale mapping.
* **Release after the reads.** On a CUDA pool, `release` sends ``Release``
  only once the GPU reads queued on the caller's streams are done (a
  released slot may be rewritten by another runner at once).
* **Nothing leaks on cancellation.** A cancelled pinned lookup or reservation
  is finished in the background (pins released, slots aborted), a failing
  `store` aborts what it reserved, a cancelled `release` still goes out.
* **Pins are dropped once per hit.** A pinned lookup names its pins with a
  fresh random id (``LookupRequest.release_id``) and the hit's release
  carries it: the node drops exactly the pins that lookup took, once, so a
  release retried after a timeout (however late), or sent again by the
  caller, never drops a pin that another hit of the same lease holds
  (`kvstore.client.releases`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from types import TracebackType

from kvstore.client import methods
from kvstore.client.background import quietly
from kvstore.client.blocks import BlockSupplier
from kvstore.client.errors import PoolEpochChanged
from kvstore.client.handles import Namespace, StoreResult
from kvstore.client.hit import Hit
from kvstore.client.lease_keeper import LeaseKeeper
from kvstore.client.query import PrefixQueries
from kvstore.client.release_after_reads import ReleaseAfterReads
from kvstore.client.releases import Releases, new_release_id
from kvstore.client.replies import hit_from_proto, request_fields
from kvstore.client.retry import RetryPolicy
from kvstore.client.rpc import ChannelOption, Rpc
from kvstore.client.session import NodeSession
from kvstore.client.tls import Pem, TLSOptions
from kvstore.client.transfer import read_hit, store_chain
from kvstore.errors import FailedPrecondition, KVStoreError, NotFound
from kvstore.hashing import Extra, HashScheme, Tokens
from kvstore.layout import KVLayout, NamespaceSpec
from kvstore.types import LeaseId
from kvstore.v1 import kvstore_pb2 as pb

__all__ = ["Client"]


class Client(PrefixQueries, ReleaseAfterReads):
    """Async gRPC client of one cache node; owns its channel, lease and mappings."""

    def __init__(
        self,
        target: str,
        *,
        tenant: str | None = None,
        token: str | None = None,
        lease_ttl: float | None = None,
        timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        map_pool: bool = True,
        client_name: str = "",
        channel_options: Sequence[ChannelOption] = (),
        tls: bool | TLSOptions = False,
        tls_root_cert: Pem | None = None,
    ) -> None:
        """Configure a client; the channel opens in `connect` (or ``async with``).

        Args:
            target: ``host:port`` of the node.
            tenant: sent as ``x-kvstore-tenant`` when given.
            token: sent as ``authorization: Bearer <token>`` when given.
            lease_ttl: TTL asked for the client's lease, in seconds; None (the
                default) takes the node's ``lease_ttl_default``. The client renews
                at a third of the TTL the node granted.
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
        tls_options: TLSOptions | None = None
        if isinstance(tls, TLSOptions):
            tls_options = tls
        elif tls or tls_root_cert is not None:
            tls_options = TLSOptions(root_cert=tls_root_cert)
        self._rpc = Rpc(
            target,
            tenant=tenant,
            token=token,
            timeout=timeout,
            retry=retry or RetryPolicy(),
            options=channel_options,
            tls=tls_options,
        )
        self._session = NodeSession(
            self._rpc, lease_ttl=lease_ttl, client_name=client_name, map_pool=map_pool
        )
        self._background = self._session.background
        self._releases = Releases(self._rpc, self._background)
        self._lease = self._session.lease

    # --- life cycle ----------------------------------------------------------------

    async def connect(self) -> None:
        """Open the channel (idempotent); the lease opens on first need."""
        await self._rpc.connect()

    async def close(self, *, end_lease: bool = True) -> None:
        """Finish cleanups, end the lease, unmap the pools, close the channel; with ``end_lease``
        False the lease expires instead (pins another process still copies from hold till then)."""
        self._releases.close()
        await self._session.close(end_lease=end_lease)
        await self._rpc.close()

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
    def timeout(self) -> float:
        """Default deadline of every call, in seconds."""
        return self._rpc.timeout

    @property
    def lease_ttl(self) -> float | None:
        """TTL of the client's lease in seconds: the node's grant once a lease is open,
        else what will be asked (None: the node's default)."""
        granted = self._lease.ttl
        return granted if granted is not None else self._session.lease_ttl

    @property
    def map_pool(self) -> bool:
        """Whether namespace pools are mapped into this process."""
        return self._session.map_pool

    @property
    def client_name(self) -> str:
        """Shown by ops tools next to the lease."""
        return self._session.client_name

    @property
    def epoch(self) -> int | None:
        """The node's pool epoch as last seen, None before the first answer carrying it."""
        return self._session.epoch

    @property
    def session(self) -> NodeSession:
        """What the client knows of its node: epoch, namespaces, lease deadlines."""
        return self._session

    @property
    def lease(self) -> LeaseKeeper:
        """The client's lease keeper (its id, generation and losses)."""
        return self._lease

    # --- namespaces ---------------------------------------------------------------------

    def owns(self, ns: Namespace) -> bool:
        """Whether ``ns`` (a hit's namespace, say) was registered through this client."""
        return self._session.namespace(ns.spec) is ns

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
        ns = self._session.namespace(spec)
        if ns is None or ns.stale:
            ns = await self._session.register(spec, capacity_bytes, timeout)
        await self._session.ensure_ready(ns, timeout)
        return ns

    # --- lookups --------------------------------------------------------------------------

    async def lookup(
        self,
        ns: Namespace,
        tokens: Tokens | None = None,
        *,
        hashes: Sequence[bytes] | None = None,
        extras: Sequence[Extra] | None = None,
        pin: bool = False,
        allow_remote: bool = False,
        timeout: float | None = None,
    ) -> Hit:
        """The longest cached prefix of a chain, pinned under the client's lease if ``pin``.

        Args:
            ns: the namespace.
            tokens: the prompt (full blocks only are looked up); or ``hashes``.
                Hashed here, under the namespace's ``chain_root``, and sent as
                hashes with the token count (docs/api.md, "The Python SDK").
            hashes: precomputed chain hashes instead of tokens.
            extras: per-block extra hash input (bytes).
            pin: pin the hit blocks under the client's lease (release them
                with `release`).
            allow_remote: when the node's own run of hits stops short, let it
                fetch the missing blocks from a peer node that holds them (see
                docs/cluster.md) and answer with them; a node without a
                cluster, or with every fetch slot busy, answers locally.
            timeout: deadline of the call (a remote fetch included).

        Redone once, transparently, when the node restarted (epoch change or
        lost lease).
        """
        for attempt in (0, 1):
            await self._session.ensure_ready(ns, timeout)
            fields = request_fields(ns, tokens, hashes, extras, query_tokens=True)
            lease_id, generation = await self._lease.current() if pin else (LeaseId(0), 0)
            req = pb.LookupRequest(
                namespace_id=ns.id,
                lease_id=lease_id,
                pin=pin,
                allow_remote=allow_remote,
                release_id=new_release_id() if pin else 0,  # names this lookup's pins
                **fields,
            )
            try:
                resp = await self._guarded_lookup(ns, req, timeout)
            except (NotFound, FailedPrecondition):
                if attempt == 0 and await self._session.recover(pin):
                    continue
                raise
            hit = hit_from_proto(ns, resp, generation, lease_id)
            hit.release.release_id = req.release_id
            if "query_tokens" in fields:  # hashed here: the chain a tokens lookup answers
                hit.packed_chain = fields["packed_hashes"]
            changed = self._session.observe_epoch(resp.pool_epoch)
            if not changed and hit.hit_blocks and self.map_pool:
                await self._follow_arenas(ns, hit, resp.pool_version, timeout)
            if changed or (self.map_pool and hit.epoch and hit.epoch != ns.epoch):
                if hit.pinned:
                    await self._background.cleanup(quietly("release", self._send_release(hit)))
                if attempt == 0:
                    continue
                raise PoolEpochChanged("the node restarted twice during one lookup", new=hit.epoch)
            return hit
        raise AssertionError("bug: unreachable")

    async def _follow_arenas(
        self, ns: Namespace, hit: Hit, version: int, timeout: float | None
    ) -> None:
        """Map arenas the node added since the mapping was made (`NodeSession.refresh_arenas`)."""
        try:
            await self._session.refresh_arenas(ns, version, timeout)
        except BaseException:
            if hit.pinned:
                await self._background.cleanup(quietly("release", self._send_release(hit)))
            raise
        hit.mapping = ns.mapping

    async def follow_pool(
        self, ns: Namespace, version: int, *, timeout: float | None = None
    ) -> None:
        """Map the pool's arenas as of ``version`` at least (0: nothing to do).

        For a process reading slots another one looked up (the vLLM worker, with
        its scheduler's `Hit.pool_version`): any mapping as new addresses them.
        """
        mapping = ns.mapping
        if not version or (mapping is not None and mapping.descriptor.version >= version):
            return
        await self._session.refresh_arenas(ns, version, timeout)

    async def follow_epoch(
        self, ns: Namespace, epoch: int, *, timeout: float | None = None
    ) -> None:
        """Remap ``ns`` when another process's lookup saw the pool at ``epoch`` (`NodeSession`)."""
        await self._session.follow_epoch(ns, epoch, timeout)

    async def _guarded_lookup(
        self,
        ns: Namespace,
        req: pb.LookupRequest,
        timeout: float | None,
    ) -> pb.LookupResponse:
        if not req.pin:
            return await self._rpc.call(methods.LOOKUP, req, timeout, idempotent=True)
        carried = self._releases.carry(req)  # the releases queued in its lane ride along
        call = asyncio.ensure_future(self._rpc.call(methods.LOOKUP, req, timeout, idempotent=False))
        call.add_done_callback(functools.partial(self._releases.settle_carried, req, carried))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            # The node may pin before we stop listening: release what it pinned.
            self._background.spawn(
                self._release_when_done(ns, LeaseId(req.lease_id), req.release_id, call)
            )
            raise

    async def _release_when_done(
        self,
        ns: Namespace,
        lease_id: LeaseId,
        release_id: int,
        call: asyncio.Future[pb.LookupResponse],
    ) -> None:
        """A pinned Lookup whose caller was cancelled: once the node answers, release
        what it pinned, through the one release route (`Releases.submit`: retried
        and sent again under the lookup's id until the node answers it)."""
        try:
            resp = await call
        except KVStoreError:
            return
        if resp.pinned and resp.hit_hashes:
            # Under the lease that pinned them: if it was replaced meanwhile,
            # the new lease's pins of the same blocks are not ours to drop.
            self._releases.submit(ns.id, lease_id, resp.hit_hashes, release_id)

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
                Hashed here, as for `lookup`.
            blocks: one block per full block of the chain (bytes, arrays or
                tensors of ``block_bytes`` each), or a callable ``i -> block``
                called only for the blocks this call must write.
            hashes: precomputed chain hashes instead of tokens.
            extras: per-block extra hash input (bytes).
            timeout: deadline of each RPC.

        On any exception or cancellation, every block this call reserved is
        aborted before the error propagates.
        """
        return await store_chain(
            self._session,
            ns,
            lambda: request_fields(ns, tokens, hashes, extras, query_tokens=False),
            blocks,
            timeout,
        )

    async def read_blocks(
        self,
        hit: Hit,
        *,
        timeout: float | None = None,
    ) -> list[bytes]:
        """The bytes of a pinned hit's blocks over gRPC (for runners that cannot map the pool)."""
        return await read_hit(self._session, hit, timeout)

    async def stats(
        self,
        *,
        timeout: float | None = None,
    ) -> pb.StatsResponse:
        """Node-wide statistics (the raw StatsResponse)."""
        resp = await self._rpc.call(methods.STATS, pb.StatsRequest(), timeout, idempotent=True)
        self._session.observe_epoch(resp.pool_epoch)
        return resp

    async def ping(
        self,
        payload: bytes = b"",
        *,
        timeout: float | None = None,
    ) -> bytes:
        """Echo ``payload`` through the node (the baseline round trip)."""
        resp = await self._rpc.call(
            methods.PING, pb.PingRequest(payload=payload), timeout, idempotent=True
        )
        return bytes(resp.payload)
