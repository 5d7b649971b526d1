"""Errors to gRPC status codes: one table, one wrapper around every handler.

A client's mistake is a `kvstore.errors.KVStoreError`; `STATUS_OF` maps each
class to exactly one status code (the most specific class in the exception's
MRO wins). `FieldError` adds the offending request field, sent as a
``google.rpc.BadRequest`` field violation in the rich status details.
Anything else escaping a handler is a bug: logged with its traceback and
answered ``INTERNAL``, never ``UNKNOWN``.

`guard_unary`, `guard_stream_out` and `guard_stream_in` wrap servicer
methods; they decode the raw request bytes (`service.api.decode`), so a
malformed request is ``INVALID_ARGUMENT`` too, and they time each call and
count errors per code (`RpcObserver`). Every message and field description
sent is cut to `MAX_ECHO_CHARS`: a request value echoed whole could overflow
gRPC's 16 KiB metadata limit and turn into ``RESOURCE_EXHAUSTED``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeAlias, TypeVar, cast

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvstore import errors as core
from service.api.decode import Context, decode, decode_stream

log = logging.getLogger(__name__)

STATUS_OF: dict[type[core.KVStoreError], grpc.StatusCode] = {
    core.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    core.NotFound: grpc.StatusCode.NOT_FOUND,
    core.UnknownNamespace: grpc.StatusCode.NOT_FOUND,
    core.UnknownLease: grpc.StatusCode.NOT_FOUND,
    core.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    core.LeaseExpired: grpc.StatusCode.FAILED_PRECONDITION,
    core.NotWriter: grpc.StatusCode.FAILED_PRECONDITION,
    core.StaleSlot: grpc.StatusCode.FAILED_PRECONDITION,
    core.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    core.LayoutConflict: grpc.StatusCode.ALREADY_EXISTS,
    core.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    core.LimitExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""The one mapping from core error classes to gRPC status codes."""


class FieldError(core.InvalidArgument):
    """Bad input in one named request field (sent as a BadRequest field violation)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message


class ResourceExhausted(core.LimitExceeded):
    """The node's memory budget cannot hold what was asked for."""


class Unauthenticated(core.PermissionDenied):
    """The call carries no credentials where some are required."""


STATUS_OF[Unauthenticated] = grpc.StatusCode.UNAUTHENTICATED


def status_code_of(exc: core.KVStoreError) -> grpc.StatusCode:
    """The status code of a core error: its most specific class in `STATUS_OF`."""
    for cls in type(exc).__mro__:
        code = STATUS_OF.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL  # a KVStoreError subclass nobody mapped: a bug


MAX_ECHO_CHARS = 500
"""Longest status message (and field description) sent; the rest is cut."""


def shorten(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters cut)"


def to_status(exc: core.KVStoreError) -> grpc.Status:
    """A `grpc.Status` for ``exc`` carrying rich details where they help."""
    code = status_code_of(exc)
    status = status_pb2.Status(code=code.value[0], message=shorten(str(exc)))
    if isinstance(exc, FieldError):
        detail = any_pb2.Any()
        detail.Pack(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field=shorten(exc.field, 100), description=shorten(exc.description)
                    )
                ]
            )
        )
        status.details.append(detail)
    answer: grpc.Status = rpc_status.to_status(status)  # grpc_status has no type stubs
    return answer


class RpcObserver(Protocol):
    """Where the guards report each call (the metrics)."""

    def observe_rpc(self, method: str, seconds: float, code: grpc.StatusCode) -> None:
        """Record one finished call."""


class Guarded(Protocol):
    """A servicer the guards can report through."""

    @property
    def observer(self) -> RpcObserver:
        """Receives one report per call."""

    @property
    def max_request_bytes(self) -> int:
        """Largest request (of a unary or server-streaming call) decoded; 0 = gRPC's bound."""


S = TypeVar("S", bound=Guarded)
Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler: TypeAlias = "Callable[[S, Req, Context], Awaitable[Resp]]"
"""A servicer method with one reply."""
StreamHandler: TypeAlias = "Callable[[S, Req, Context], AsyncIterator[Resp]]"
"""A servicer method that streams its replies (an async generator)."""

_INTERNAL = status_pb2.Status(code=code_pb2.INTERNAL, message="internal error; see server log")


async def _fail(context: Context, method: str, exc: BaseException) -> grpc.StatusCode:
    """Abort the call for ``exc``; returns the code sent. Re-raises what must pass."""
    if isinstance(exc, core.KVStoreError):
        status = to_status(exc)
        code: grpc.StatusCode = status.code
        await context.abort_with_status(status)
        return code  # pragma: no cover - abort_with_status raises
    log.error("bug: %s raised an unexpected exception", method, exc_info=exc)
    await context.abort_with_status(rpc_status.to_status(_INTERNAL))
    return grpc.StatusCode.INTERNAL  # pragma: no cover


def _passes(exc: BaseException) -> bool:
    # AbortError carries a status the handler already chose; cancellation and
    # interpreter exits must propagate untouched.
    return isinstance(exc, (grpc.aio.AbortError, asyncio.CancelledError)) or not isinstance(
        exc, Exception
    )


def _code_of(exc: BaseException, context: Context) -> grpc.StatusCode:
    if isinstance(exc, core.KVStoreError):
        return status_code_of(exc)
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    code = context.code()
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.INTERNAL


def _guard(method: str, *, drain: bool) -> Callable[[Handler[S, Req, Resp]], Handler[S, Req, Resp]]:
    def wrap(handler: Handler[S, Req, Resp]) -> Handler[S, Req, Resp]:
        @functools.wraps(handler)
        async def guarded(self: S, request: Req, context: Context) -> Resp:
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            # ``request`` is raw bytes (a stream of them for ``drain``): the handler
            # gets the message of its own type, the one ``method`` names.
            raws = cast("AsyncIterator[bytes]", request)
            try:
                if drain:
                    message = cast(Req, decode_stream(method, raws))
                else:
                    message = cast(Req, decode(method, request, self.max_request_bytes))
                return await handler(self, message, context)
            except BaseException as exc:
                code = _code_of(exc, context)
                if _passes(exc):
                    raise
                if drain:
                    await _drain(raws)
                code = await _fail(context, method, exc)
                raise  # pragma: no cover - _fail raised
            finally:
                self.observer.observe_rpc(method, time.perf_counter() - started, code)

        return guarded

    return wrap


def guard_unary(method: str) -> Callable[[Handler[S, Req, Resp]], Handler[S, Req, Resp]]:
    """Wrap a unary-response handler: map errors, time it, count its status."""
    return _guard(method, drain=False)


def guard_stream_out(
    method: str,
) -> Callable[[StreamHandler[S, Req, Resp]], StreamHandler[S, Req, Resp]]:
    """Wrap a server-streaming handler (an async generator) like `guard_unary`."""

    def wrap(handler: StreamHandler[S, Req, Resp]) -> StreamHandler[S, Req, Resp]:
        @functools.wraps(handler)
        async def guarded(self: S, request: Req, context: Context) -> AsyncIterator[Resp]:
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                message = cast(Req, decode(method, request, self.max_request_bytes))
                async for item in handler(self, message, context):
                    yield item
            except BaseException as exc:
                code = _code_of(exc, context)
                if _passes(exc):
                    raise
                code = await _fail(context, method, exc)
                raise  # pragma: no cover
            finally:
                self.observer.observe_rpc(method, time.perf_counter() - started, code)

        return guarded

    return wrap


DRAIN_MESSAGES = 4096
"""Most request messages `guard_stream_in` reads past an error before answering."""
DRAIN_SECONDS = 1.0
"""Longest it waits for them."""


async def _drain(requests: AsyncIterator[bytes]) -> None:
    """Read what the client is still sending (bounded), so it has half-closed.

    A grpc.aio client whose write fails after the server's status arrived
    reports ``INTERNAL: Internal error from Core`` instead of that status
    (grpc/grpc#36066). Ending a client-streaming call only once the client
    has sent everything keeps the real status code on the client's side.
    """
    with contextlib.suppress(Exception):
        async with asyncio.timeout(DRAIN_SECONDS):
            count = 0
            async for _ in requests:
                count += 1
                if count >= DRAIN_MESSAGES:
                    break


def guard_stream_in(method: str) -> Callable[[Handler[S, Req, Resp]], Handler[S, Req, Resp]]:
    """Wrap a client-streaming handler like `guard_unary`, draining the stream on errors."""
    return _guard(method, drain=True)
