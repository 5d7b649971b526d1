"""Request bytes to messages, inside the error guard; the raw-bytes handler table.

gRPC's generated ``add_KVStoreServicer_to_server`` decodes each request before
the handler runs, so malformed protobuf bytes, a truncated message or invalid
UTF-8 in a string field failed outside every guard and reached the client as
``UNKNOWN``. `add_servicer` registers the same handlers with no request
deserializer: each handler receives the raw bytes, and its guard decodes them
with `decode` (or `decode_stream` for a client stream), so a decode failure is
a `MalformedRequest`, answered ``INVALID_ARGUMENT``. Responses are serialized
as usual; server reflection reads the descriptors, not the handlers, so
grpcurl keeps working.

`decode` also refuses a request over the node's ``max_request_bytes`` before
parsing it: parsing runs on the event loop, so its size is bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc
from google.protobuf.message import DecodeError, Message

from kvstore import errors as core
from kvstore.v1 import kvstore_pb2 as pb

Context: TypeAlias = "grpc.aio.ServicerContext[bytes, Message]"
"""A KVStore handler's servicer context: raw request bytes in (`add_servicer`), messages out."""

SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
"""The KVStore service descriptor."""

REQUEST_TYPES: dict[str, type[Message]] = {
    m.name: getattr(pb, m.input_type.name) for m in SERVICE.methods
}
"""Request message class of every KVStore method."""

_RESPONSE_TYPES: dict[str, type[Message]] = {
    m.name: getattr(pb, m.output_type.name) for m in SERVICE.methods
}


class MalformedRequest(core.InvalidArgument):
    """The request bytes are not a valid message of the method's request type."""


class RequestTooLarge(core.InvalidArgument):
    """A request is bigger than ``max_request_bytes``."""


def decode(method: str, raw: object, max_bytes: int) -> Message:
    """The request message of ``method`` parsed from ``raw``.

    ``raw`` that is already a message (a test calling the servicer directly)
    is returned as is.

    Raises:
        RequestTooLarge: ``raw`` is over ``max_bytes`` (0 = no bound).
        MalformedRequest: ``raw`` is not a valid message of the request type.
    """
    if isinstance(raw, Message):  # a test calling the servicer directly
        return raw
    assert isinstance(raw, bytes), f"bug: a {type(raw).__name__} for request bytes"
    cls = REQUEST_TYPES[method]
    if max_bytes and len(raw) > max_bytes:
        raise RequestTooLarge(
            f"the {method} request is {len(raw)} bytes, over max_request_bytes ({max_bytes})"
        )
    try:
        return cls.FromString(raw)
    except (DecodeError, UnicodeDecodeError, ValueError) as exc:
        # upb reports invalid UTF-8 in a string field as a DecodeError too.
        raise MalformedRequest(
            f"the request is not a valid {cls.DESCRIPTOR.full_name}: {str(exc)[:200]}"
        ) from None


async def decode_stream(method: str, raws: AsyncIterator[object]) -> AsyncIterator[Message]:
    """`decode` each message of a client stream (bounded by gRPC's max message size)."""
    async for raw in raws:
        yield decode(method, raw, 0)


def add_servicer(servicer: object, server: grpc.aio.Server) -> None:
    """Register every KVStore method of ``servicer`` on ``server``, taking raw request bytes."""
    # Raw bytes in (decoded inside the guard), messages out.
    handlers: dict[str, grpc.RpcMethodHandler[bytes, Message]] = {}
    for m in SERVICE.methods:
        serialize = _RESPONSE_TYPES[m.name].SerializeToString
        behaviour = getattr(servicer, m.name)
        if m.client_streaming and m.server_streaming:  # pragma: no cover - none today
            make = grpc.stream_stream_rpc_method_handler
        elif m.client_streaming:
            make = grpc.stream_unary_rpc_method_handler
        elif m.server_streaming:
            make = grpc.unary_stream_rpc_method_handler
        else:
            make = grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(behaviour, request_deserializer=None, response_serializer=serialize)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
