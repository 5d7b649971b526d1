"""Tenants: who is calling, and the secret salt their chains start from.

`TenantResolver.caller` turns a call's metadata into a `Caller`:

- Auth off (no ``tenants_file``, the embedded/dev default): the tenant is
  whatever ``x-kvstore-tenant`` says (default ``"default"``). Any client can
  claim any tenant: trust mode, for a single user or a closed network only.
- Auth on: ``x-kvstore-tenant`` is ignored entirely; the tenant comes only
  from ``authorization: Bearer <token>`` looked up in the tenants file
  (`service.tenancy.tenants`). No token or an unknown one is ``UNAUTHENTICATED``.
  The admin token authenticates the admin, who is no tenant.

`ChainRoots` derives each tenant's salt as HMAC-SHA256(salt_secret, tenant)
on the server (a client never chooses its salt, so it cannot pick another
tenant's) and the chain root of a namespace for that tenant.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.hashing import HashScheme, kvstore_root, vllm_root
from kvstore.layout import NamespaceSpec
from kvstore.types import BlockHash, TenantId
from service.api.errors import Unauthenticated
from service.tenancy.auth import bearer_token
from service.tenancy.tenants import TenantDirectory, TenantPolicy

TENANT_HEADER = "x-kvstore-tenant"
"""Metadata key naming the caller's tenant when auth is off (ignored when it is on)."""

DEFAULT_TENANT = TenantId("default")
"""The tenant of a call that names none."""

ADMIN_CALLER = TenantId("_admin")
"""The `Caller.tenant` of the admin (not a valid tenant name, so no tenant's)."""

ROOT_CACHE_SIZE = 65536
"""Chain roots (tenant x namespace) kept; the least recently used are recomputed."""

_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling, as far as this node can tell."""

    tenant: TenantId
    """The tenant (`ADMIN_CALLER` for the admin)."""
    admin: bool = False
    """Authenticated with the admin token (auth on only)."""
    policy: TenantPolicy | None = None
    """The tenant's entry in the tenants file; None with auth off, or for the admin."""

    @property
    def sees_all(self) -> bool:
        """May inspect every tenant's blocks, counters and events (admin, or auth off)."""
        return self.policy is None


class TenantResolver:
    """Maps a call's metadata to its `Caller` (see the module docstring)."""

    def __init__(
        self,
        default: TenantId = DEFAULT_TENANT,
        *,
        directory: TenantDirectory | None = None,
        admin_token: str = "",
    ) -> None:
        self.default = default
        self.directory = directory
        self.admin_token = admin_token

    @property
    def auth_on(self) -> bool:
        """Whether tokens are required (a tenants file is configured)."""
        return self.directory is not None

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Caller:
        """The caller of a call with this metadata.

        Raises:
            Unauthenticated: auth is on and the call has no token, or one that
                is neither a tenant's nor the admin's.
            InvalidArgument: auth is off and the tenant header is malformed.
        """
        if self.directory is None:
            return Caller(self.resolve(metadata))
        token = bearer_token(metadata)
        if not token:
            raise Unauthenticated(
                "this node requires a tenant token: send 'authorization: Bearer <token>'"
            )
        if self.admin_token and hmac.compare_digest(token.encode(), self.admin_token.encode()):
            return Caller(ADMIN_CALLER, admin=True)
        policy = self.directory.authenticate(token)
        if policy is None:
            raise Unauthenticated("the token is not valid on this node")
        return Caller(policy.tenant, policy=policy)

    def resolve(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> TenantId:
        """The tenant named by ``metadata``, or the default.

        Raises:
            InvalidArgument: the header is present but not a valid tenant name
                (1-128 characters of letters, digits and ``._:@-``).
        """
        for key, value in metadata or ():
            if key == TENANT_HEADER:
                name = value.decode(errors="replace") if isinstance(value, bytes) else value
                if not _TENANT_RE.match(name):
                    raise InvalidArgument(
                        f"{TENANT_HEADER} {name[:64]!r} is not a valid tenant name "
                        "(1-128 letters, digits or ._:@-, starting with a letter or digit)"
                    )
                return TenantId(name)
        return self.default


class ChainRoots:
    """Per-tenant salts and chain roots, derived from the node's secret."""

    def __init__(self, salt_secret: bytes) -> None:
        if not salt_secret:
            raise ValueError("bug: ChainRoots needs a resolved (non-empty) salt secret")
        self._secret = salt_secret
        # Least recently used first; bounded, since tenant names are unbounded with auth off.
        self._cache: collections.OrderedDict[tuple[NamespaceSpec, TenantId, bool], BlockHash] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        """Chain roots cached (at most `ROOT_CACHE_SIZE`)."""
        return len(self._cache)

    def salt(self, tenant: TenantId) -> bytes:
        """HMAC-SHA256(salt_secret, tenant): the tenant's secret salt."""
        return hmac.new(self._secret, tenant.encode(), hashlib.sha256).digest()

    def root(self, spec: NamespaceSpec, tenant: TenantId, *, shared: bool) -> BlockHash:
        """The hash chain root of ``spec`` for ``tenant``.

        Shared namespaces use an empty salt (every tenant computes the same
        chain); the vLLM scheme uses vLLM's seed root, where tenants are kept
        apart by the store's per-tenant scopes alone.
        """
        if spec.scheme is HashScheme.VLLM_SHA256_CBOR:
            return vllm_root(spec.vllm_seed)
        # Keyed by the (frozen) spec: its digest is a JSON encoding and a
        # SHA-256, ~50 µs that every tokens Lookup paid before the cache hit.
        key = (spec, tenant, shared)
        root = self._cache.get(key)
        if root is not None:
            self._cache.move_to_end(key)
            return root
        root = kvstore_root(spec.digest(), b"" if shared else self.salt(tenant))
        self._cache[key] = root
        if len(self._cache) > ROOT_CACHE_SIZE:  # bounded: tenants x namespaces
            self._cache.popitem(last=False)
        return root
