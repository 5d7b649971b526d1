"""gRPC status codes map back to the core's error classes."""

from __future__ import annotations

import grpc
import pytest

from kvstore import errors as core
from kvstore.client import (
    DeadlineExceeded,
    ServerError,
    ServerUnavailable,
    Unauthenticated,
    error_from_rpc,
    error_from_status,
)


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, core.InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, core.NotFound),
        (grpc.StatusCode.FAILED_PRECONDITION, core.FailedPrecondition),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, core.LimitExceeded),
        (grpc.StatusCode.ALREADY_EXISTS, core.AlreadyExists),
        (grpc.StatusCode.PERMISSION_DENIED, core.PermissionDenied),
        (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
        (grpc.StatusCode.UNAVAILABLE, ServerUnavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.INTERNAL, ServerError),
        (grpc.StatusCode.UNIMPLEMENTED, ServerError),
    ],
)
def test_mapping(code: grpc.StatusCode, cls: type[core.KVStoreError]) -> None:
    err = error_from_status(code, "what went wrong")
    assert type(err) is cls
    assert "what went wrong" in str(err)


def test_hierarchy() -> None:
    assert issubclass(Unauthenticated, core.PermissionDenied)
    assert issubclass(DeadlineExceeded, ServerUnavailable)
    err = error_from_status(grpc.StatusCode.INTERNAL, None)
    assert isinstance(err, ServerError) and err.code is grpc.StatusCode.INTERNAL


def test_from_rpc_error() -> None:
    rpc = grpc.aio.AioRpcError(
        grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), "no such namespace"
    )
    err = error_from_rpc(rpc)
    assert isinstance(err, core.NotFound) and str(err) == "no such namespace"
