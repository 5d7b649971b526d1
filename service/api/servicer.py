"""The KVStore servicer: leases and namespaces here, the rest in the mixins.

Every method only translates: proto in, validated domain values to the
store, domain results back to proto. Errors leave through the guards of
`service.api.errors`, mapped to status codes in one table.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from typing import Any

from kvstore.errors import KVStoreError
from kvstore.hashing import HashScheme
from kvstore.layout import NamespaceSpec
from kvstore.types import LeaseId
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.api import translate, validate
from service.api.admin import AdminRpcs
from service.api.blocks import BlockRpcs
from service.api.data import DataRpcs
from service.api.errors import FieldError, guard_unary
from service.api.peer import PeerRpcs
from service.api.query import QueryRpcs

log = logging.getLogger(__name__)


def new_lease_id() -> LeaseId:
    """An unguessable nonzero 63-bit lease id."""
    while True:
        value = secrets.randbits(63)
        if value:
            return LeaseId(value)


class KVStoreServicer(
    BlockRpcs, DataRpcs, AdminRpcs, PeerRpcs, QueryRpcs, kvstore_pb2_grpc.KVStoreServicer
):
    """The whole KVStore service of one node."""

    # --- leases -----------------------------------------------------------------

    @guard_unary("OpenLease")
    async def OpenLease(self, request: pb.OpenLeaseRequest, context: Any) -> pb.OpenLeaseResponse:
        """Open a lease with the asked TTL (0 = the node's default)."""
        node = self.node
        tenant = node.tenant(context)
        ttl = validate.ttl(
            request.ttl_seconds, node.config.lease_ttl_default, node.config.lease_ttl_max
        )
        lease = node.store.open_lease(new_lease_id(), tenant, ttl, node.now())
        node.pools.report_mapped(lease.lease_id, request.pool_versions)  # holds CUDA arenas
        log.debug("lease %d opened for %s (%s)", lease.lease_id, tenant, request.client_name)
        return pb.OpenLeaseResponse(
            lease_id=lease.lease_id, ttl_seconds=ttl, pool_epoch=node.epoch, node_id=node.node_id
        )

    @guard_unary("KeepAlive")
    async def KeepAlive(self, request: pb.KeepAliveRequest, context: Any) -> pb.KeepAliveResponse:
        """Extend a live lease by its TTL."""
        node = self.node
        tenant = node.tenant(context)
        now = node.now()
        lease = node.store.renew_lease(validate.lease_id(request.lease_id), tenant, now)
        node.pools.report_mapped(lease.lease_id, request.pool_versions)
        return pb.KeepAliveResponse(ttl_seconds=lease.deadline - now, pool_epoch=node.epoch)

    @guard_unary("CloseLease")
    async def CloseLease(
        self, request: pb.CloseLeaseRequest, context: Any
    ) -> pb.CloseLeaseResponse:
        """End a lease now: release its pins and abort its writes."""
        node = self.node
        tenant = node.tenant(context)
        lease_id = validate.lease_id(request.lease_id)
        report = node.store.close_lease(lease_id, tenant, node.now())
        node.pools.held.lease_ended(lease_id)
        node.publish_events()
        return pb.CloseLeaseResponse(
            pins_released=report.pins_dropped, writes_aborted=report.writes_aborted
        )

    # --- namespaces -----------------------------------------------------------

    @guard_unary("RegisterNamespace")
    async def RegisterNamespace(
        self, request: pb.RegisterNamespaceRequest, context: Any
    ) -> pb.RegisterNamespaceResponse:
        """Create a namespace and its pool, or return the existing one (idempotent)."""
        node = self.node
        tenant = node.tenant(context)
        if not request.model_id:
            raise FieldError("model_id", "is required")
        node.check_model(tenant, request.model_id)
        scheme = translate.scheme_from_proto(request.scheme)
        if request.vllm_seed and scheme is not HashScheme.VLLM_SHA256_CBOR:
            raise FieldError("vllm_seed", "is only used by the vllm-sha256-cbor scheme")
        spec = NamespaceSpec(
            model_id=request.model_id,
            layout=translate.layout_from_proto(request.layout),
            scheme=scheme,
            vllm_seed=request.vllm_seed,
        )
        table, created = await node.register(spec, request.capacity_bytes)
        return pb.RegisterNamespaceResponse(
            namespace_id=table.namespace,
            created=created,
            capacity_blocks=table.capacity,
            block_bytes=table.spec.layout.block_bytes,
            chain_root=node.root(table, tenant),
            shared=table.shared,
            layout=translate.layout_to_proto(table.spec.layout),
            scheme=translate.scheme_to_proto(table.spec.scheme),
            verify_local_loads=node.config.verify_checksums == "all",
        )

    @guard_unary("AttachPool")
    async def AttachPool(
        self, request: pb.AttachPoolRequest, context: Any
    ) -> pb.AttachPoolResponse:
        """Describe the pool of a namespace so a runner can map it."""
        node = self.node
        tenant = node.tenant(context)
        namespace = self.namespace(request.namespace_id, tenant)
        descriptor = node.pool(namespace).descriptor
        if request.lease_id and node.pools.kind == "cuda":
            # The lease holds what the runner maps until it reports a newer version;
            # a lease that ended holds nothing (the runner opens another).
            with contextlib.suppress(KVStoreError):
                lease = node.store.lease(validate.lease_id(request.lease_id), tenant, node.now())
                mapped = request.mapped_version or descriptor.version
                node.pools.held.attached(lease.lease_id, namespace, mapped)
        return translate.attach_response(descriptor, node.table(namespace).spec.layout)
