"""The internal lease a peer fetch writes under, whatever carries the bytes.

Shared by the gRPC stream (`service.cluster.peer_fetch`) and NIXL
(`service.cluster.nixl_fetch`): open the node's own lease in the tenant's
name, reserve the missing blocks of a chain under it, close it (which aborts
whatever was not committed).
"""

from __future__ import annotations

import contextlib
import secrets

from kvstore.errors import KVStoreError
from kvstore.types import BlockHash, LeaseId, NamespaceId, TenantId
from service.cluster.local import LocalNode


def open_fetch_lease(node: LocalNode, tenant: TenantId) -> LeaseId:
    """The fetch's internal lease: the node's own, outside the tenant's lease limit.

    At most `peer_fetch_concurrency` exist at once, so the node bounds them.
    """
    lease_id = LeaseId(secrets.randbits(63) | 1)
    ttl = node.config.peer_fetch_timeout + 1.0
    node.store.open_lease(lease_id, tenant, ttl, node.now(), internal=True)
    return lease_id


def reserve_missing(
    node: LocalNode,
    namespace: NamespaceId,
    tenant: TenantId,
    lease_id: LeaseId,
    target: list[BlockHash],
) -> set[BlockHash]:
    """Reserve ``target``'s missing blocks; returns those this fetch must write."""
    result = node.store.reserve(namespace, tenant, lease_id, target, node.now())
    node.publish_events()  # the reservation may have evicted blocks
    return set(result.reserved_hashes())


def close_fetch_lease(node: LocalNode, tenant: TenantId, lease_id: LeaseId) -> None:
    """Close the lease, aborting its unwritten reservations (expired: already aborted)."""
    with contextlib.suppress(KVStoreError):
        node.store.close_lease(lease_id, tenant, node.now())
    node.publish_events()
