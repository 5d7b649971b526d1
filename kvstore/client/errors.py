"""Errors of the client SDK: gRPC status codes back to `kvstore.errors` classes.

The server maps each core error class to one status code
(``service/api/errors.py``); `error_from_rpc` is the inverse, so runner code
catches the same classes whether it talks to a store in-process or over
gRPC. The original `grpc.aio.AioRpcError` is the ``__cause__``.

Exception tree (client additions marked ``+``)::

    KVStoreError
    ├── InvalidArgument                INVALID_ARGUMENT, OUT_OF_RANGE
    ├── NotFound                       NOT_FOUND (unknown namespace or lease)
    ├── FailedPrecondition             FAILED_PRECONDITION (lease expired, stale slot)
    │   ├── + PoolEpochChanged         the node restarted: mappings were dropped
    │   └── + BlocksMoved              a copied block's slot stamp moved: recompute it
    ├── AlreadyExists                  ALREADY_EXISTS (a layout conflict)
    ├── PermissionDenied               PERMISSION_DENIED
    │   └── + Unauthenticated          UNAUTHENTICATED (missing or bad token)
    ├── LimitExceeded                  RESOURCE_EXHAUSTED
    ├── + ServerUnavailable            UNAVAILABLE after the retries
    │   └── + DeadlineExceeded         DEADLINE_EXCEEDED after the retries
    └── + ServerError                  any other code (INTERNAL, UNIMPLEMENTED, …): a bug
"""

from __future__ import annotations

import grpc

from kvstore.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    LimitExceeded,
    NotFound,
    PermissionDenied,
)


class PoolEpochChanged(FailedPrecondition):
    """The node's pool epoch changed (it restarted): every mapping was dropped.

    Views handed out before are no longer backed by the node's pool; look the
    blocks up again.
    """

    def __init__(self, message: str, old: int | None = None, new: int | None = None) -> None:
        super().__init__(message)
        self.old = old
        """The epoch the mapping was attached with."""
        self.new = new
        """The epoch the node reports now."""


class BlocksMoved(FailedPrecondition):
    """A load copied blocks whose slot stamps moved, or whose bytes failed their
    writer's checksum: those bytes must not be used.

    Raised by `Hit.copy_into` after its copy (`Hit.verify` says the same as a
    value). The blocks before ``intact`` were proven; recompute from there.
    """

    def __init__(
        self, message: str, intact: int, moved: tuple[int, ...], corrupt: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message)
        self.intact = intact
        """Leading blocks whose copied bytes are proven (usable)."""
        self.moved = moved
        """Indices of the blocks whose stamp moved."""
        self.corrupt = corrupt
        """Indices of the blocks whose copy did not have their writer's checksum: report
        them with the release (``Client.release(hit, corrupt=...)``)."""


class Unauthenticated(PermissionDenied):
    """The call carried no valid credentials (``UNAUTHENTICATED``)."""


class ServerUnavailable(KVStoreError):
    """The node could not be reached (``UNAVAILABLE``), retries included."""


class DeadlineExceeded(ServerUnavailable):
    """The call's timeout passed before the node answered (``DEADLINE_EXCEEDED``)."""


class ServerError(KVStoreError):
    """The node answered with a status that is no client mistake (a server bug)."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code
        """The gRPC status code the node answered with."""


ERROR_OF: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceeded,
    grpc.StatusCode.UNAVAILABLE: ServerUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}
"""The one table from status codes to error classes (the server's, inverted)."""


def error_from_status(code: grpc.StatusCode, details: str | None) -> KVStoreError:
    """The `KVStoreError` for a status code and its details message."""
    message = details or code.name
    cls = ERROR_OF.get(code)
    if cls is None:
        return ServerError(f"{code.name}: {message}", code)
    return cls(message)


def error_from_rpc(err: grpc.RpcError) -> KVStoreError:
    """The `KVStoreError` for a failed call (raise it ``from err``)."""
    return error_from_status(err.code(), err.details())
