"""Bad request bytes and oversized values: INVALID_ARGUMENT, never UNKNOWN, INTERNAL
or RESOURCE_EXHAUSTED for what is the client's mistake."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
from grpc_status import rpc_status

from kvstore.v1 import kvstore_pb2 as pb
from tests.inproc import LAYOUT

INVALID = grpc.StatusCode.INVALID_ARGUMENT
SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
MAX_REQUEST_BYTES = 64 << 10

GARBAGE = {
    "not protobuf": b"\xff\xff\xff\xff",
    "a truncated varint": b"\x08\x80",
    "a field longer than the message": b"\x0a\x10abc",
    "an invalid wire type": b"\x0f",
}
"""Bytes that no request message parses from."""


@pytest.fixture
def server_config(server_config):
    return replace(server_config, max_request_bytes=MAX_REQUEST_BYTES)


def raw_call(channel: grpc.aio.Channel, method: str):
    """A callable sending raw bytes to ``method`` (no client-side serialization)."""
    desc = SERVICE.methods_by_name[method]
    path = f"/{SERVICE.full_name}/{method}"
    if desc.client_streaming:
        return channel.stream_unary(path)
    if desc.server_streaming:
        return channel.unary_stream(path)
    return channel.unary_unary(path)


async def code_of(channel: grpc.aio.Channel, method: str, payload: bytes) -> grpc.aio.AioRpcError:
    """Send ``payload`` to ``method``; the call must fail; returns the error."""
    desc = SERVICE.methods_by_name[method]
    call = raw_call(channel, method)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        if desc.client_streaming:
            await call(iter([payload]), timeout=5)
        elif desc.server_streaming:
            async for _ in call(payload, timeout=5):
                pass
        else:
            await call(payload, timeout=5)
    return err.value


@pytest.mark.parametrize("what", sorted(GARBAGE))
async def test_malformed_bytes_are_invalid_argument_on_every_method(channel, what):
    for method in (m.name for m in SERVICE.methods):
        err = await code_of(channel, method, GARBAGE[what])
        assert err.code() == INVALID, (method, what, err.code(), err.details())
        assert "not a valid kvstore.v1." in err.details(), (method, err.details())


async def test_a_truncated_message_is_invalid_argument(channel, namespace):
    whole = pb.LookupRequest(namespace_id=namespace.id, packed_hashes=b"".join([b"\1" * 32] * 3))
    raw = whole.SerializeToString()
    for cut in (1, 5, len(raw) - 1):
        err = await code_of(channel, "Lookup", raw[:cut])
        assert err.code() == INVALID, (cut, err.code(), err.details())


async def test_invalid_utf8_in_a_string_field_is_invalid_argument(channel):
    # Field 1 (namespace_id / model_id) of these requests is a string.
    for method in ("Lookup", "RegisterNamespace", "ListBlocks", "ReadBlocks", "WatchEvents"):
        err = await code_of(channel, method, b"\x0a\x02\xff\xfe")
        assert err.code() == INVALID, (method, err.code(), err.details())
        assert "UTF-8" in err.details(), err.details()
    header = b"\x0a\x04\x0a\x02\xff\xfe"  # WriteBlocksRequest.header.namespace_id
    err = await code_of(channel, "WriteBlocks", header)
    assert err.code() == INVALID, err.details()


async def test_a_request_over_max_request_bytes_is_refused_before_parsing(stub):
    big = pb.LookupRequest(namespace_id="0123456789abcdef", extras=[b"x" * MAX_REQUEST_BYTES])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Lookup(big, timeout=5)
    assert err.value.code() == INVALID
    assert "max_request_bytes" in err.value.details()


async def test_grpcurl_style_reflection_still_lists_the_service(channel):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]))  # fmt: skip
    names = [s.name async for r in replies for s in r.list_services_response.service]
    assert SERVICE.full_name in names


@pytest.mark.parametrize(
    "token",
    ["o²", "o" + "9" * 5000, "o99999999999999999999", "o", "o-1"],
    ids=["unicode-digit", "5000-digits", "over-int64", "no-digits", "negative"],
)
async def test_list_blocks_rejects_odd_page_tokens(stub, namespace, token):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ListBlocks(
            pb.ListBlocksRequest(namespace_id=namespace.id, page_token=token), timeout=5
        )
    assert err.value.code() == INVALID, err.value.details()
    assert "page_token" in err.value.details()


async def test_a_huge_echoed_value_is_cut_not_resource_exhausted(stub):
    layout = pb.KVLayout()
    layout.CopyFrom(LAYOUT)
    layout.dtype = "\u00e9" * 20_000  # 40 kB of UTF-8; percent-encoded it would be 120 kB
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id="m", layout=layout), timeout=5
        )
    assert err.value.code() == INVALID, (err.value.code(), err.value.details()[:200])
    assert "dtype" in err.value.details()
    assert len(err.value.details()) < 1000
    status = rpc_status.from_call(err.value)
    assert status is None or len(status.message) < 1000
