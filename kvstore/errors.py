"""Typed errors of the kvstore core.

A caller's mistake is one of these; a capacity shortfall is a *result*
(`NO_ROOM`, a partial reservation), never an exception; a broken invariant is
an ``AssertionError`` or ``RuntimeError`` that says it is a bug. The service
maps each class to one gRPC status code in a single table
(``service/api/errors.py``).

Exception tree::

    KVStoreError
    ├── InvalidArgument          bad input: sizes, hashes, layouts, ttl
    ├── NotFound
    │   ├── UnknownNamespace
    │   └── UnknownLease
    ├── FailedPrecondition
    │   ├── LeaseExpired         the lease ended (expired or closed)
    │   ├── NotWriter            commit of a block this lease did not reserve
    │   └── StaleSlot            a (slot, generation) that was reused
    ├── AlreadyExists
    │   └── LayoutConflict       same model id registered with another layout
    ├── PermissionDenied         a tenant touching what is not its own
    └── LimitExceeded            a bound (pins per lease, leases per tenant…)
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error the kvstore core raises for a caller's mistake."""


class InvalidArgument(KVStoreError):
    """The request itself is malformed (wrong size, bad value, empty chain)."""


class NotFound(KVStoreError):
    """The request names something that does not exist."""


class UnknownNamespace(NotFound):
    """No namespace with this id is registered on this node."""


class UnknownLease(NotFound):
    """No lease with this id was ever issued by this node (or it was forgotten)."""


class FailedPrecondition(KVStoreError):
    """The request is well formed but the state does not allow it."""


class LeaseExpired(FailedPrecondition):
    """The lease expired or was closed; its pins and writes are gone."""


class NotWriter(FailedPrecondition):
    """The block is not WRITING under this lease (never reserved, or aborted)."""


class StaleSlot(FailedPrecondition):
    """A (slot, generation) pair names a slot that has since been reused."""


class AlreadyExists(KVStoreError):
    """Creating something that exists in a conflicting form."""


class LayoutConflict(AlreadyExists):
    """A namespace id is registered with a different KV layout."""


class PermissionDenied(KVStoreError):
    """The caller's tenant may not do this."""


class LimitExceeded(KVStoreError):
    """A configured bound would be exceeded (pins per lease, leases per tenant)."""
