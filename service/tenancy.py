"""Tenants: who is calling, and the secret salt their chains start from.

`TenantResolver` reads the tenant from call metadata (``x-kvstore-tenant``,
default ``"default"``). Token authentication replaces it later behind the
same seam: ``resolve(metadata) -> TenantId``.

`ChainRoots` derives each tenant's salt as HMAC-SHA256(salt_secret, tenant)
on the server (a client never chooses its salt, so it cannot pick another
tenant's) and the chain root of a namespace for that tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable

from kvstore.errors import InvalidArgument
from kvstore.hashing import HashScheme, kvstore_root, vllm_root
from kvstore.layout import NamespaceSpec
from kvstore.types import BlockHash, TenantId

TENANT_HEADER = "x-kvstore-tenant"
"""Metadata key naming the caller's tenant (until token auth lands)."""

DEFAULT_TENANT = TenantId("default")
"""The tenant of a call that names none."""

_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


class TenantResolver:
    """Maps a call's metadata to its tenant (the seam where auth tokens go)."""

    def __init__(self, default: TenantId = DEFAULT_TENANT) -> None:
        self.default = default

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
        self._cache: dict[tuple[bytes, TenantId, bool], BlockHash] = {}

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
        digest = spec.digest()
        key = (digest, tenant, shared)
        root = self._cache.get(key)
        if root is None:
            root = kvstore_root(digest, b"" if shared else self.salt(tenant))
            if len(self._cache) > 65536:  # bounded: tenants x namespaces
                self._cache.clear()
            self._cache[key] = root
        return root
