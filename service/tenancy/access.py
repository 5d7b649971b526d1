"""Who is calling, and what they may do: the checks every servicer method makes.

The node's side of tenancy (`Node` takes it in): the caller of a call and its
tenant (the admin is no tenant), the admin rule, which models a tenant may
use, its quota of resident blocks and which models' blocks tenants share.
Who a token names is `service.tenancy.callers`; the tenants file is
`service.tenancy.tenants`; the admin rule itself, `service.tenancy.auth`.
"""

from __future__ import annotations

from kvstore.errors import PermissionDenied
from kvstore.types import SHARED_SCOPE, TenantId
from service.api.decode import Context
from service.config import Config
from service.tenancy import auth
from service.tenancy.callers import Caller, TenantResolver
from service.tenancy.tenants import TenantDirectory

__all__ = ["TenantAccess"]


class TenantAccess:
    """`Node`'s tenancy checks (a mixin: the node module stays one concept long)."""

    config: Config
    directory: TenantDirectory | None
    tenants: TenantResolver

    def caller(self, context: Context) -> Caller:
        """Who is calling (`TenantResolver.caller`): tenant, admin, policy."""
        return self.tenants.caller(context.invocation_metadata())

    def tenant(self, context: Context) -> TenantId:
        """The calling tenant, for cache operations (the admin is no tenant)."""
        caller = self.caller(context)
        if caller.admin:
            raise PermissionDenied(
                "the admin token names no tenant: use a tenant's token for cache operations"
            )
        return caller.tenant

    def require_admin(self, context: Context) -> None:
        """Raise unless the caller may use the admin verbs (`service.tenancy.auth`)."""
        if not self.tenants.auth_on:
            self.tenant(context)  # a malformed tenant header is still INVALID_ARGUMENT
        auth.require_admin(context, self.config.admin_token, loopback_ok=not self.tenants.auth_on)

    def check_model(self, tenant: TenantId, model_id: str) -> None:
        """Raise `PermissionDenied` unless ``tenant`` may use ``model_id``'s namespace."""
        if self.directory is None:
            return
        policy = self.directory.policy(tenant)
        if policy is None or not policy.may_use(model_id):
            raise PermissionDenied(
                f"tenant {tenant!r} may not use model {model_id!r} "
                "(its namespaces in the tenants file)"
            )

    def quota_of(self, scope: TenantId) -> int:
        """Resident blocks a scope may hold per namespace (shared scopes: no quota)."""
        if self.directory is None or scope == SHARED_SCOPE:
            return 0
        return self.directory.max_blocks(scope)

    def is_shared(self, model_id: str) -> bool:
        """Whether the operator made this model's blocks shared between tenants."""
        return model_id in self.config.shared_namespaces
