"""The tenants file: which tokens authenticate which tenant, and its limits.

Auth is on when `Config.tenants_file` names one. TOML (or JSON, by suffix)::

    [tenants.alice]
    token_sha256 = ["9f86d08...15b0f00a08"]   # sha256 hex of each token (preferred)
    tokens = ["plaintext-token"]               # accepted too; keeps secrets in the file
    namespaces = ["meta-llama/Llama-3.1-8B"]   # model ids it may use, or ["*"]
    max_blocks = 4096                          # resident blocks per namespace (0 = no quota)
    max_leases = 64                            # live leases (0 = the node's default)

A presented token is hashed with SHA-256 and looked up by digest, so the
lookup takes the same time whatever prefix of a valid token an attacker
guesses (what leaks is at most a digest prefix, which reveals nothing of the
token); the file need not hold any token in plain text.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from kvstore.types import TenantId
from service.config.schema import read_document

ANY_NAMESPACE = "*"
"""Entry of ``namespaces`` that allows every model id."""

MIN_TOKEN_CHARS = 16
"""Shortest plaintext token accepted (a guessable token is no authentication)."""

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
_HEX64_RE = re.compile(r"^[0-9a-fA-F]{64}$")
_KEYS = {"tokens", "token_sha256", "namespaces", "max_blocks", "max_leases"}


class TenantsFileError(ValueError):
    """The tenants file is unreadable or malformed."""


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """What one authenticated tenant may do."""

    tenant: TenantId
    """The tenant's name: its scope and the input of its salt."""
    namespaces: frozenset[str]
    """Model ids it may use; ``{"*"}`` for all."""
    max_blocks: int = 0
    """Resident blocks per namespace (0 = no quota)."""
    max_leases: int = 0
    """Live leases (0 = the node's max_leases_per_tenant)."""

    def may_use(self, model_id: str) -> bool:
        """Whether this tenant may use the namespace of ``model_id``."""
        return ANY_NAMESPACE in self.namespaces or model_id in self.namespaces


def token_digest(token: str) -> bytes:
    """SHA-256 of a token: the key tokens are looked up by."""
    return hashlib.sha256(token.encode()).digest()


class TenantDirectory:
    """Token digests → tenant policies, loaded from the tenants file."""

    def __init__(self, policies: dict[TenantId, TenantPolicy], digests: dict[bytes, TenantId]):
        self.policies = policies
        self._digests = digests

    def authenticate(self, token: str) -> TenantPolicy | None:
        """The policy of the tenant that ``token`` belongs to, or None."""
        tenant = self._digests.get(token_digest(token))
        return self.policies[tenant] if tenant is not None else None

    def policy(self, tenant: TenantId) -> TenantPolicy | None:
        """A tenant's policy by name."""
        return self.policies.get(tenant)

    def max_blocks(self, tenant: TenantId) -> int:
        """A tenant's quota per namespace (0 = none; unknown scopes have none)."""
        policy = self.policies.get(tenant)
        return policy.max_blocks if policy is not None else 0

    def max_leases(self, tenant: TenantId) -> int:
        """A tenant's lease bound (0 = the node's default)."""
        policy = self.policies.get(tenant)
        return policy.max_leases if policy is not None else 0

    @classmethod
    def load(cls, path: str) -> TenantDirectory:
        """Read and check a tenants file (see the module docstring)."""
        return cls.parse(read_document(path, "tenants file", TenantsFileError), path)

    @classmethod
    def parse(cls, doc: object, source: str = "tenants file") -> TenantDirectory:
        """Build a directory from a parsed document ``{"tenants": {name: {...}}}``."""
        tenants = doc.get("tenants") if isinstance(doc, dict) else None
        if not isinstance(tenants, dict) or not tenants:
            raise TenantsFileError(f"{source}: needs a [tenants.NAME] table per tenant")
        policies: dict[TenantId, TenantPolicy] = {}
        digests: dict[bytes, TenantId] = {}
        for name, entry in tenants.items():
            where = f"{source}: tenant {name!r}"
            if not _NAME_RE.match(name):
                raise TenantsFileError(f"{where}: not a valid tenant name (letters, digits, ._:@-)")
            if not isinstance(entry, dict):
                raise TenantsFileError(f"{where}: must be a table")
            unknown = sorted(set(entry) - _KEYS)
            if unknown:
                raise TenantsFileError(f"{where}: unknown keys {unknown}")
            tenant = TenantId(name)
            found = _digests_of(entry, where)
            if not found:
                raise TenantsFileError(f"{where}: needs at least one of tokens / token_sha256")
            for digest in found:
                if digests.setdefault(digest, tenant) != tenant:
                    raise TenantsFileError(f"{where}: a token is also {digests[digest]!r}'s")
            namespaces = entry.get("namespaces")
            if not isinstance(namespaces, list) or not all(isinstance(n, str) for n in namespaces):
                raise TenantsFileError(f"{where}: namespaces must be a list of model ids or ['*']")
            policies[tenant] = TenantPolicy(
                tenant=tenant,
                namespaces=frozenset(namespaces),
                max_blocks=_count(entry, "max_blocks", where),
                max_leases=_count(entry, "max_leases", where),
            )
        return cls(policies, digests)


def _digests_of(entry: dict[str, object], where: str) -> list[bytes]:
    digests: list[bytes] = []
    for token in _strings(entry, "tokens", where):
        if len(token) < MIN_TOKEN_CHARS:
            raise TenantsFileError(f"{where}: tokens need at least {MIN_TOKEN_CHARS} characters")
        digests.append(token_digest(token))
    for hexed in _strings(entry, "token_sha256", where):
        if not _HEX64_RE.match(hexed):
            raise TenantsFileError(f"{where}: token_sha256 entries are 64 hex digits")
        digests.append(bytes.fromhex(hexed))
    return digests


def _strings(entry: dict[str, object], key: str, where: str) -> list[str]:
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TenantsFileError(f"{where}: {key} must be a list of strings")
    return value


def _count(entry: dict[str, object], key: str, where: str) -> int:
    value = entry.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TenantsFileError(f"{where}: {key} must be a non-negative integer")
    return value
