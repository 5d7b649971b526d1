"""FetchBlocks: the node-to-node read that peer fetch (`service.cluster.peer_fetch`) uses.

Only cache nodes call it. When `cluster_token` is configured the call must
carry it (``x-kvstore-peer-token``, compared in constant time); with auth on
(a tenants file) it is always required. With auth off and no token, any
caller that can reach the gRPC port may read a tenant's blocks by naming the
tenant and the block hashes, so such nodes belong on a private network
(docs/cluster.md). No lease is taken: the chain is looked up once, then
each block is checked (slot and generation still the same READY block) and
copied in the same synchronous step, so a block evicted mid-stream is never
read; the stream simply ends there. The lookup is a peek: it counts in no
tenant's hit statistics and does not refresh the blocks in the LRU.

A chain whose run in memory stops where this node's disk tier goes on (the
directory names a node for blocks in its pool or on its disk) is served
from the disk too: those blocks are promoted into the pool first
(`service.disk.promote`, the lookup's own path: slot header and checksum
verified, within ``disk_promote_timeout``), then streamed like any READY
block, with the checksum the promotion committed them with, which the
fetching node checks again.

OfferBlocks / EndOffer are the same read over NIXL (`service.cluster.nixl_offers`):
the same token check, tenant scope and peek, but the blocks are named by
address in the node's registered memory for the peer's NIXL READ, and
EndOffer says how many of them are still intact afterwards. A node without
NIXL answers FAILED_PRECONDITION, and the peer streams.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Iterable

from kvstore.errors import FailedPrecondition, PermissionDenied, StaleSlot
from kvstore.results import LookupResult, MissReason
from kvstore.types import BlockHash, NamespaceId, TenantId
from kvstore.v1 import kvstore_pb2 as pb
from service.api import validate
from service.api.base import ServicerBase
from service.api.decode import Context
from service.api.errors import Unauthenticated, guard_stream_out, guard_unary
from service.cluster.peer_fetch import PEER_TOKEN_HEADER
from service.node import Node
from service.tenancy.callers import TENANT_HEADER


def check_peer_token(
    metadata: Iterable[tuple[str, str | bytes]] | None, expected: str, *, auth_on: bool = False
) -> None:
    """Raise unless the call carries the cluster token.

    No token configured: allowed with auth off (trust mode), refused with auth
    on (the request names any tenant, so without the cluster token it would
    bypass tenant authentication).
    """
    if not expected:
        if auth_on:
            raise PermissionDenied(
                "FetchBlocks needs cluster_token when auth is on, and this node has none "
                "configured (set cluster_token / KVSTORE_CLUSTER_TOKEN on every node)"
            )
        return
    for key, value in metadata or ():
        if key == PEER_TOKEN_HEADER:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            if hmac.compare_digest(text.encode(), expected.encode()):
                return
            raise PermissionDenied("FetchBlocks: wrong cluster token")
    raise Unauthenticated(f"FetchBlocks is for peer nodes: send {PEER_TOKEN_HEADER}")


async def peek_with_disk(
    node: Node, namespace: NamespaceId, tenant: TenantId, chain: list[BlockHash]
) -> LookupResult:
    """A peek lookup of ``chain``, after promoting what this node's disk tier holds
    past the run in memory (nothing without a disk tier)."""
    result = node.store.lookup(namespace, tenant, chain, node.now(), peek=True)
    promoter = node.promoter
    if promoter is None or result.miss_reason is not MissReason.ABSENT:
        return result
    if not (await promoter.promote(namespace, tenant, chain, result.hit_blocks)).look_again:
        return result
    return node.store.lookup(namespace, tenant, chain, node.now(), peek=True)


class PeerRpcs(ServicerBase):
    """The node-to-node RPCs of the KVStore service."""

    @guard_stream_out("FetchBlocks")
    async def FetchBlocks(
        self, request: pb.FetchBlocksRequest, context: Context
    ) -> AsyncIterator[pb.BlockData]:
        """Stream READY blocks of a tenant's chain from ``skip`` on, in order."""
        node = self.node
        check_peer_token(
            context.invocation_metadata(), node.config.cluster_token, auth_on=node.tenants.auth_on
        )
        tenant = node.tenants.resolve(((TENANT_HEADER, request.tenant),))
        namespace = self.namespace(request.namespace_id, None)
        chain = validate.block_hashes(request.hashes, node.config.max_chain_blocks)
        # A peek: a peer's read is not the tenant's use of this node's cache,
        # so it moves nothing in the LRU and counts in no hit statistics.
        result = await peek_with_disk(node, namespace, tenant, chain)
        pool = node.pool(namespace)
        for ref in result.blocks[request.skip :]:
            try:
                node.store.check_slot(namespace, tenant, ref)
            except StaleSlot:
                return  # evicted since the lookup: the caller keeps what it got
            # The checksum its writer sent, not one of the bytes now: the
            # reader checks that what lands is what was written.
            yield pb.BlockData(hash=ref.hash, data=pool.read(ref.slot), checksum=ref.checksum)

    @guard_unary("OfferBlocks")
    async def OfferBlocks(
        self, request: pb.OfferBlocksRequest, context: Context
    ) -> pb.OfferBlocksResponse:
        """Pin a tenant's chain from ``skip`` on and name its blocks' memory for a NIXL READ."""
        node = self.node
        check_peer_token(
            context.invocation_metadata(), node.config.cluster_token, auth_on=node.tenants.auth_on
        )
        if node.nixl is None:
            raise FailedPrecondition("this node offers no NIXL transport: use FetchBlocks")
        tenant = node.tenants.resolve(((TENANT_HEADER, request.tenant),))
        namespace = self.namespace(request.namespace_id, None)
        chain = validate.block_hashes(request.hashes, node.config.max_chain_blocks)
        await peek_with_disk(node, namespace, tenant, chain)  # promoted: offered from the pool
        return node.nixl.offers.offer(
            namespace,
            tenant,
            chain,
            request.skip,
            request.known_agent,
            request.known_metadata_version,
        )

    @guard_unary("EndOffer")
    async def EndOffer(self, request: pb.EndOfferRequest, context: Context) -> pb.EndOfferResponse:
        """Forget an offer; how many of its blocks are still intact (0: unknown offer)."""
        node = self.node
        check_peer_token(
            context.invocation_metadata(), node.config.cluster_token, auth_on=node.tenants.auth_on
        )
        intact = node.nixl.offers.end(request.offer_id) if node.nixl is not None else 0
        return pb.EndOfferResponse(intact=intact)
