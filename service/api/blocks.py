"""Lookup, Reserve, Commit, Abort, Release: chain operations, translated."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from kvstore.block_table import BlockTable
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.types import BlockHash, LeaseId, NamespaceId, TenantId
from kvstore.v1 import kvstore_pb2 as pb
from service.api import chains, releases, translate, validate
from service.api.base import ServicerBase
from service.api.decode import Context
from service.api.errors import FieldError, guard_unary
from service.api.offload import off_loop
from service.cluster.lookup import LookupCall

_HashesRequest = pb.CommitRequest | pb.AbortRequest
"""The requests that name a lease and a list of block hashes."""

_StoreVerb = Callable[[NamespaceId, TenantId, LeaseId, Sequence[BlockHash], float], int]
"""`Store.commit` or `Store.abort`."""


class BlockRpcs(ServicerBase):
    """The block operations of the KVStore service."""

    @guard_unary("Lookup")
    async def Lookup(self, request: pb.LookupRequest, context: Context) -> pb.LookupResponse:
        """Longest cached prefix of a chain, pinned under the lease when asked.

        A carried release (``request.release``) is checked with the rest of the
        request, then applied right before the lookup, with no ``await``
        between them: one call does a busy runner's Release and its next Lookup.
        ``release_id`` (with ``pin``) names the pins this lookup takes: a
        release naming it drops exactly those, once (docs/leases.md).
        """
        node = self.node
        tenant = node.tenant(context)
        namespace = self.namespace(request.namespace_id, tenant)
        lease_id = None
        if request.pin:
            if not request.lease_id:
                raise FieldError("lease_id", "pin=true needs the lease to pin under")
            lease_id = validate.lease_id(request.lease_id)
        elif request.release_id:
            raise FieldError("release_id", "names the pins of a pinned lookup; set pin=true")
        release_id: int = request.release_id
        carried = releases.carried(request, node.config.max_chain_blocks)
        table = node.table(namespace)
        chain, query_tokens, from_tokens = await self.chain(table, tenant, request)
        if request.query_tokens:
            query_tokens = chains.hashed_from(
                request.query_tokens, chain, from_tokens, table.block_size
            )
        if release_id and lease_id is not None:
            # Checked before the carried release is applied: a refused lookup applies nothing.
            try:
                node.store.check_release_id(tenant, lease_id, release_id, node.now())
            except InvalidArgument as exc:
                raise FieldError("release_id", str(exc)) from None
        released = None
        if carried is not None:  # applied right before the lookup: no await between
            released = releases.apply(
                node.store,
                namespace,
                tenant,
                LeaseId(request.lease_id),
                carried,
                node.now(),
                node.drop_corrupt,
            )
            node.publish_events()
        result = await node.lookup(
            LookupCall(
                namespace,
                tenant,
                chain,
                query_tokens,
                lease_id=lease_id,
                release_id=release_id,
                allow_remote=request.allow_remote,
            )
        )
        pool = node.pool(namespace)
        reply = translate.lookup_reply(pool, result)  # a few µs: on the loop, no await
        if from_tokens:
            reply["packed_chain"] = b"".join(chain)
        return pb.LookupResponse(
            hit_blocks=result.hit_blocks,
            hit_tokens=result.hit_blocks * table.block_size,
            pinned=result.pinned and bool(result.hit_blocks),
            miss_reason=int(result.miss_reason),  # type: ignore[arg-type]
            pool_epoch=node.epoch,
            query_tokens=query_tokens,
            pool_version=pool.descriptor.version,
            released=released,
            **reply,
        )

    @guard_unary("Reserve")
    async def Reserve(self, request: pb.ReserveRequest, context: Context) -> pb.ReserveResponse:
        """Slots for the missing blocks of a chain, owned by the lease."""
        node = self.node
        tenant = node.tenant(context)
        namespace = self.namespace(request.namespace_id, tenant)
        lease_id = validate.lease_id(request.lease_id)
        table = node.table(namespace)
        chain, _, _ = await self.chain(table, tenant, request)
        await node.make_room(table, tenant, chain)  # more arenas, if the budget allows
        try:
            result = node.store.reserve(namespace, tenant, lease_id, chain, node.now())
        finally:
            node.publish_events()  # a reservation may have evicted blocks
        pool = node.pool(namespace)
        try:
            reply = await off_loop(len(result.hashes), translate.packed_reserve, pool, result)
        except BaseException:
            # Cancelled while the reply was built: give back what was reserved.
            reserved = result.reserved_hashes()
            if reserved:
                with contextlib.suppress(KVStoreError):
                    node.store.abort(namespace, tenant, lease_id, reserved, node.now())
                node.publish_events()
            raise
        return pb.ReserveResponse(
            pool_epoch=node.epoch, pool_version=pool.descriptor.version, **reply
        )

    async def chain(
        self, table: BlockTable, tenant: TenantId, request: pb.LookupRequest | pb.ReserveRequest
    ) -> tuple[list[BlockHash], int, bool]:
        """The chain a Lookup or Reserve names, bounded, hashed off the loop."""
        config = self.node.config
        tokens, hashes = chains.request_chain(request, config.max_chain_blocks)
        # Only tokens are hashed under the root: a chain of hashes needs none.
        root = self.node.root(table, tenant) if len(tokens) else BlockHash(b"")
        return await chains.chain(
            root,
            table.block_size,
            table.spec.scheme,
            tokens,
            hashes,
            request.extras,
            max_blocks=config.max_chain_blocks,
            max_tokens=config.max_request_tokens,
            hashes_checked=True,
        )

    def _named_blocks(
        self, request: _HashesRequest, context: Context, limit: int
    ) -> tuple[NamespaceId, TenantId, LeaseId, list[BlockHash]]:
        """The namespace, tenant, lease and (at most ``limit``) hashes a request names, checked."""
        tenant = self.node.tenant(context)
        namespace = self.namespace(request.namespace_id, tenant)
        lease_id = validate.lease_id(request.lease_id)
        return namespace, tenant, lease_id, chains.named_hashes(request, limit)

    def _on_hashes(self, request: _HashesRequest, context: Context, verb: _StoreVerb) -> int:
        """Validate a (namespace, lease, hashes) request and apply ``verb`` to it."""
        node = self.node
        named = self._named_blocks(request, context, node.config.max_chain_blocks)
        count = verb(*named, node.now())
        node.publish_events()
        return count

    @guard_unary("Commit")
    async def Commit(self, request: pb.CommitRequest, context: Context) -> pb.CommitResponse:
        """Make written blocks READY."""
        node = self.node
        named = self._named_blocks(request, context, node.config.max_chain_blocks)
        required = node.pool(named[0]).descriptor.checksummed
        checksums = validate.checksums(request.packed_checksums, len(named[3]), required)
        return pb.CommitResponse(committed=node.commit(*named, checksums=checksums))

    @guard_unary("Abort")
    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        """Free reserved blocks that will not be written."""
        aborted = self._on_hashes(request, context, self.node.store.abort)
        return pb.AbortResponse(aborted=aborted)

    @guard_unary("Release")
    async def Release(self, request: pb.ReleaseRequest, context: Context) -> pb.ReleaseResponse:
        """Drop this lease's pins on the named blocks (several hits' at once with ``runs``).

        Every bound is checked before any work (`releases.plan`); each run is
        then one `Store.release`, under its release id when the client sent
        ids (a retry drops nothing twice).
        """
        node = self.node
        tenant = node.tenant(context)
        namespace = self.namespace(request.namespace_id, tenant)
        lease_id = validate.lease_id(request.lease_id)
        checked = releases.plan(request, node.config.max_chain_blocks)
        reply = releases.apply(
            node.store, namespace, tenant, lease_id, checked, node.now(), node.drop_corrupt
        )
        node.publish_events()
        return reply
