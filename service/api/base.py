"""What every group of servicer methods shares: the node and the error guard's observer."""

from __future__ import annotations

from kvstore.types import NamespaceId, TenantId
from service.api import validate
from service.api.errors import RpcObserver
from service.node import Node


class ServicerBase:
    """Holds the `Node`; the RPC groups (mixins) translate on top of it."""

    def __init__(self, node: Node) -> None:
        self.node = node

    @property
    def observer(self) -> RpcObserver:
        """Where the error guards report each call (the node's metrics)."""
        return self.node.metrics

    @property
    def max_request_bytes(self) -> int:
        """Largest request the guards decode (``max_request_bytes`` of the config)."""
        return self.node.config.max_request_bytes

    def namespace(self, value: str, tenant: TenantId | None) -> NamespaceId:
        """A well-formed namespace id that is registered here and ``tenant`` may use.

        ``tenant`` None skips the permission check (the admin, or inspection
        with auth off).
        """
        namespace = validate.namespace_id(value)
        table = self.node.table(namespace)
        if tenant is not None:
            self.node.check_model(tenant, table.spec.model_id)
        return namespace
