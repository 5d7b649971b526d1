"""Who may use the admin verbs (Evict, Clear): the one place that decides.

The rule (docs/operations.md):

- ``admin_token`` set: the call must carry ``authorization: Bearer <token>``
  metadata. No token is ``UNAUTHENTICATED``; a wrong one ``PERMISSION_DENIED``.
  Tokens are compared in constant time.
- ``admin_token`` empty: admin verbs are accepted only from loopback peers
  (127.0.0.0/8, ::1, a unix socket), i.e. an operator on the node's own host;
  any other peer gets ``PERMISSION_DENIED`` naming the setting to configure.

- Auth on (a ``tenants_file`` is configured): the admin token is always
  required, with no loopback exemption: on a multi-tenant node every tenant's
  runner is a local process, and loopback proves nothing about who it is.
  No ``admin_token`` configured then means no admin verbs at all.

Tenant tokens travel in the same metadata key (`service.tenancy.callers`).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable

from kvstore.errors import PermissionDenied
from service.api.decode import Context
from service.api.errors import Unauthenticated

AUTH_HEADER = "authorization"
"""Metadata key carrying ``Bearer <token>``."""

_BEARER = "bearer "


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of the call's ``authorization: Bearer <token>`` metadata, if any."""
    for key, value in metadata or ():
        if key.lower() == AUTH_HEADER:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            if text[: len(_BEARER)].lower() == _BEARER:
                return text[len(_BEARER) :].strip()
            return text.strip()
    return None


def is_loopback_peer(peer: str) -> bool:
    """Whether a gRPC peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``) is local."""
    if peer.startswith("unix:") or peer.startswith("unix-abstract:"):
        return True
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        host = rest.rsplit(":", 1)[0]
    elif kind == "ipv6":
        host = rest.rsplit(":", 1)[0].strip("[]")
    else:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_admin(
    metadata: Iterable[tuple[str, str | bytes]] | None,
    peer: str,
    admin_token: str,
    *,
    loopback_ok: bool = True,
) -> None:
    """Raise unless the caller may use the admin verbs (see the module docstring).

    Raises:
        Unauthenticated: a token is configured and the call carries none.
        PermissionDenied: a wrong token, or no token configured and a remote peer.
    """
    token = bearer_token(metadata)
    if admin_token:
        if token is None:
            raise Unauthenticated(
                "admin verbs need the admin token: send 'authorization: Bearer <token>' "
                "(kvstore --admin-token or KVSTORE_ADMIN_TOKEN)"
            )
        if not hmac.compare_digest(token.encode(), admin_token.encode()):
            raise PermissionDenied("the admin token is not valid")
        return
    if not loopback_ok:
        raise PermissionDenied(
            "admin verbs need the admin token when auth is on, and this node has none "
            "configured (set admin_token / KVSTORE_ADMIN_TOKEN on the node)"
        )
    if not is_loopback_peer(peer):
        raise PermissionDenied(
            "admin verbs from other hosts need an admin token, and this node has none "
            "configured (set admin_token / KVSTORE_ADMIN_TOKEN on the node)"
        )


def require_admin(context: Context, admin_token: str, *, loopback_ok: bool = True) -> None:
    """`check_admin` for a grpc.aio servicer context."""
    check_admin(context.invocation_metadata(), context.peer(), admin_token, loopback_ok=loopback_ok)
