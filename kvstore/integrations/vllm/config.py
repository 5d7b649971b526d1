"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

    kv_transfer_config={
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"target": "127.0.0.1:50051", "tenant": "acme"},
    }

Every key is optional; unknown keys and values out of range are an error
at start-up, naming the key (a typo must not silently turn the cache off, nor
a bad value crash the engine on its first request). `docs/vllm.md` lists
them with examples.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvstore.errors import InvalidArgument

DEFAULT_TARGET = "127.0.0.1:50051"


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """How the vLLM connector reaches its cache node and what it may do there."""

    target: str = DEFAULT_TARGET
    """``host:port`` of the cache node (default: ``$KVSTORE_TARGET`` or the local node)."""
    tenant: str = ""
    """Tenant name sent as ``x-kvstore-tenant`` (nodes with auth off)."""
    token: str = ""
    """Tenant bearer token (nodes with auth on); the token decides the tenant."""
    tls: bool = False
    """Connect over TLS (implied by ``tls_root_cert``)."""
    tls_root_cert: str = ""
    """CA bundle file the node's certificate must chain to."""
    tls_client_cert: str = ""
    """Client certificate file for mutual TLS."""
    tls_client_key: str = ""
    """Client key file for mutual TLS."""
    model_id: str = ""
    """Names the exact weights (``org/model@revision``); default: vLLM's model and revision."""
    lookup_timeout: float = 2.0
    """Seconds a lookup may take before the request is computed without the cache."""
    allow_remote: bool = True
    """Where the node has a cluster (Redis), a lookup that stops short may fetch the rest
    of the prefix from a peer node first (``Lookup.allow_remote``); a node without one
    ignores it. A fetch that fails or outlives ``lookup_timeout`` is a miss."""
    store_timeout: float = 5.0
    """Seconds a store (reserve, copy, commit) may take before it is given up."""
    connect_timeout: float = 5.0
    """Seconds to register the namespace and map the pool."""
    retry_interval: float = 5.0
    """After a failed call the node is left alone this long (requests are computed)."""
    lease_ttl: float = 0.0
    """TTL of the connector's leases (0: the node's default); a dead engine's pins drop after it."""
    capacity_bytes: int = 0
    """Pool size to ask for when this connector registers the namespace first (0: node's)."""
    load: bool = True
    """Load cached prefixes into vLLM."""
    save: bool = True
    """Save newly computed full blocks (of prompts; of outputs too with ``save_decode``)."""
    save_decode: bool = True
    """Save the generated tokens' full blocks too, as they fill: a chat's next turn,
    which repeats this answer, finds it on any engine."""
    max_pending_save_bytes: int = 256 * 1024 * 1024
    """Bytes of copied-out blocks that may wait for the node; a save beyond it is dropped."""
    fail_loads: bool = False
    """Testing only: every load reports its blocks as failed (vLLM recomputes them)."""

    def __post_init__(self) -> None:
        """Refuse values out of range, naming the key (see `_RANGES`)."""
        for name, (low, inclusive) in _RANGES.items():
            value = getattr(self, name)
            if not math.isfinite(value) or value < low or (value == low and not inclusive):
                bound = f">= {low}" if inclusive else f"> {low}"
                raise InvalidArgument(
                    f"kvstore connector setting {name!r} must be a finite number {bound}: {value!r}"
                )
        if not self.target.strip():
            raise InvalidArgument("kvstore connector setting 'target' must not be empty")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``, with ``$KVSTORE_TARGET`` as the default target.

        Raises:
            InvalidArgument: an unknown key or a value of the wrong type.
        """
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise InvalidArgument(
                f"unknown kvstore connector settings {unknown}; known: {sorted(known)}"
            )
        values: dict[str, Any] = {}
        if "target" not in extra and os.environ.get("KVSTORE_TARGET"):
            values["target"] = os.environ["KVSTORE_TARGET"]
        for name, value in extra.items():
            default = known[name].default
            values[name] = _coerce(name, value, type(default))
        return cls(**values)

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `kvstore.client.Client` for these settings."""
        from kvstore.client import TLSOptions

        kwargs: dict[str, Any] = {
            "lease_ttl": self.lease_ttl or None,
            "timeout": self.lookup_timeout,
        }
        if self.tenant:
            kwargs["tenant"] = self.tenant
        if self.token:
            kwargs["token"] = self.token
        if self.tls_client_cert or self.tls_client_key:
            kwargs["tls"] = TLSOptions(
                root_cert=self.tls_root_cert or None,
                client_cert=self.tls_client_cert or None,
                client_key=self.tls_client_key or None,
            )
        elif self.tls or self.tls_root_cert:
            kwargs["tls"] = TLSOptions(root_cert=self.tls_root_cert or None)
        return kwargs


_RANGES: dict[str, tuple[float, bool]] = {
    "lookup_timeout": (0.0, False),
    "store_timeout": (0.0, False),
    "connect_timeout": (0.0, False),
    "retry_interval": (0.0, True),
    "lease_ttl": (0.0, True),
    "capacity_bytes": (0, True),
    "max_pending_save_bytes": (0, True),
}
"""Numeric settings: (lowest value, whether it is allowed)."""


def _coerce(name: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
    elif kind is int and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return int(value)
        except ValueError:
            pass
    elif kind is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
    elif kind is str and isinstance(value, str):
        return value
    raise InvalidArgument(f"kvstore connector setting {name!r} must be {kind.__name__}: {value!r}")
