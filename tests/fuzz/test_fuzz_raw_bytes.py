"""Raw wire bytes against every RPC of a live node: never UNKNOWN, INTERNAL or
RESOURCE_EXHAUSTED for what is the client's mistake.

`test_fuzz_rpcs` sends well-formed messages; this one sends bytes that gRPC
hands to the node as they are: random bytes, truncations and bit flips of
valid requests (built with the node's real namespace and lease so they get
past the first checks), and valid requests with invalid UTF-8 in a string
field (top level or one message down). Client-streaming calls get a stream
of such messages. A fixed seed makes every run the same calls.

``KVSTORE_RAW_FUZZ_CALLS`` sets the calls per method (default 300).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections import Counter
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from kvstore.v1 import kvstore_pb2 as pb
from service.server import Server
from tests.fuzz.node import LAYOUT, config
from tests.fuzz.wire import varint
from tests.replies import entries_of

SEED = 20261203
CALLS_PER_METHOD = int(os.environ.get("KVSTORE_RAW_FUZZ_CALLS", "300"))
SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
FORBIDDEN = {
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""What malformed client bytes must never produce (the messages stay far under the size limits)."""

BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok\xf8\x88\x80\x80\x80", b"\xe2\x82"]


def _length_delimited(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def valid_request(descriptor: Descriptor, real: dict[str, Any]) -> Any:
    """A plausible request: the fields whose names say what they are get real values."""
    msg = getattr(pb, descriptor.name)()
    for name, value in real.items():
        if name in descriptor.fields_by_name:
            fd = descriptor.fields_by_name[name]
            try:
                if fd.is_repeated:
                    getattr(msg, name).extend(value)
                elif fd.type == FieldDescriptor.TYPE_MESSAGE:
                    getattr(msg, name).CopyFrom(value)
                else:
                    setattr(msg, name, value)
            except (TypeError, ValueError):
                pass  # the same name with another type here (Evict's blocks is a count)
    return msg


def bad_utf8(descriptor: Descriptor, rng: random.Random) -> bytes | None:
    """A string field (top level or one message down) holding invalid UTF-8, or None."""
    paths = [(fd,) for fd in descriptor.fields if fd.type == FieldDescriptor.TYPE_STRING]
    for fd in descriptor.fields:
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            paths += [
                (fd, sub)
                for sub in fd.message_type.fields
                if sub.type == FieldDescriptor.TYPE_STRING
            ]
    if not paths:
        return None
    path = rng.choice(paths)
    payload = rng.choice(BAD_UTF8)
    for fd in reversed(path):
        payload = _length_delimited(fd.number, payload)
    return payload


def mutate(valid: bytes, descriptor: Descriptor, rng: random.Random) -> bytes:
    """One malformed variant of ``valid`` (a serialized request)."""
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 200))
    if kind == 1 and valid:
        return valid[: rng.randrange(0, len(valid))]  # truncated
    if kind == 2 and valid:
        flipped = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        return bytes(flipped)
    if kind == 3:
        utf8 = bad_utf8(descriptor, rng)
        if utf8 is not None:
            return valid + utf8  # the later field wins when parsed
    return valid + rng.randbytes(rng.randrange(1, 20))  # trailing garbage


async def call_raw(channel: grpc.aio.Channel, method: str, payloads: list[bytes]) -> Any:
    desc = SERVICE.methods_by_name[method]
    path = f"/{SERVICE.full_name}/{method}"
    timeout = 0.3 if method == "WatchEvents" else 5.0
    try:
        if desc.client_streaming:
            await channel.stream_unary(path)(iter(payloads), timeout=timeout)
        elif desc.server_streaming:
            async for _ in channel.unary_stream(path)(payloads[0], timeout=timeout):
                if method == "WatchEvents":
                    return grpc.StatusCode.OK
        else:
            await channel.unary_unary(path)(payloads[0], timeout=timeout)
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and method == "WatchEvents":
            return grpc.StatusCode.OK  # a valid watch waits for events
        return err.code()
    return grpc.StatusCode.OK


async def real_values(channel: grpc.aio.Channel) -> dict[str, Any]:
    from kvstore.v1 import kvstore_pb2_grpc

    stub = kvstore_pb2_grpc.KVStoreStub(channel)
    ns = (
        await stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id="raw-fuzz", layout=LAYOUT), timeout=5
        )
    ).namespace_id
    lease = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=600), timeout=5)).lease_id
    tokens = list(range(1, 17))
    res = await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns, lease_id=lease, tokens=tokens), timeout=5
    )
    hashes = [e.hash for e in entries_of(res)]
    return {
        "namespace_id": ns,
        "lease_id": lease,
        "tokens": tokens,
        "hashes": hashes,
        "runs": [len(hashes)],  # Release's: its mutations flip and truncate runs too
        "model_id": "raw-fuzz",
        "layout": LAYOUT,
        "payload": b"ping",
        "blocks": [pb.BlockRef(hash=hashes[0], slot=entries_of(res)[0].location.slot)],
        "header": pb.WriteBlocksHeader(namespace_id=ns, lease_id=lease),
    }


async def ping(channel: grpc.aio.Channel) -> bytes:
    call = channel.unary_unary(f"/{SERVICE.full_name}/Ping")
    reply: bytes = await call(pb.PingRequest(payload=b"alive").SerializeToString(), timeout=5)
    return reply


def test_raw_bytes_never_unknown_internal_or_exhausted(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    rng = random.Random(SEED)
    codes: Counter[str] = Counter()
    bad: list[str] = []
    with asyncio.Runner() as runner:
        server = Server(config(tmp_path), expiry_tick=0.05)
        runner.run(server.start())
        channel = grpc.aio.insecure_channel(server.address)
        try:
            real = runner.run(real_values(channel))
            for method in sorted(m.name for m in SERVICE.methods):
                desc = SERVICE.methods_by_name[method]
                valid = valid_request(desc.input_type, real).SerializeToString()
                if desc.client_streaming:
                    header = pb.WriteBlocksRequest(header=real["header"]).SerializeToString()
                    block = valid_request(pb.WriteBlocksRequest.DESCRIPTOR, {}).SerializeToString()
                for _ in range(CALLS_PER_METHOD):
                    payload = mutate(valid, desc.input_type, rng)
                    payloads = [payload]
                    if desc.client_streaming:
                        payloads = rng.choice(
                            [[header, payload], [payload, header], [header, block, payload]]
                        )
                    code = runner.run(call_raw(channel, method, payloads))
                    codes[code.name] += 1
                    if code in FORBIDDEN or code == grpc.StatusCode.DEADLINE_EXCEEDED:
                        bad.append(f"{method} -> {code.name}: {payloads!r:.300}")
            print(f"raw fuzz: status codes {dict(sorted(codes.items()))}")
            assert not bad, bad[:5]
            pong = runner.run(ping(channel))
            assert pb.PingResponse.FromString(pong).payload == b"alive"
        finally:
            runner.run(channel.close())
            runner.run(server.stop(0.1))
    assert codes[grpc.StatusCode.INVALID_ARGUMENT.name] > len(SERVICE.methods) * 10
    bugs = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert bugs == [], f"the node logged errors for client bytes: {bugs[:5]}"


def hostile_release(real: dict[str, Any], runs: bytes) -> bytes:
    """A Release of the real lease and hashes with ``runs`` as raw packed varints."""
    head = pb.ReleaseRequest(
        namespace_id=real["namespace_id"],
        lease_id=real["lease_id"],
        packed_hashes=b"".join(real["hashes"]),
    ).SerializeToString()
    return head + _length_delimited(5, runs)


async def call_once(method: Any, payload: bytes) -> Any:
    return await method(payload, timeout=5)


def test_raw_release_runs_are_bounded(tmp_path: Any) -> None:
    """Empty runs, more runs than hashes, more than MAX_RELEASE_RUNS: INVALID_ARGUMENT
    naming ``runs``, whatever their number (each run was once a release on the loop)."""
    from kvstore.api.wire import MAX_RELEASE_RUNS

    with asyncio.Runner() as runner:
        server = Server(config(tmp_path), expiry_tick=0.05)
        runner.run(server.start())
        channel = grpc.aio.insecure_channel(server.address)
        release = channel.unary_unary(f"/{SERVICE.full_name}/Release")
        try:
            real = runner.run(real_values(channel))
            n = len(real["hashes"])
            cases = {
                "a run then 500k empty": varint(n) + b"\x00" * 500_000,
                "one empty run": b"\x00",
                "more runs than hashes": b"\x01" * (n + 1),
                "over the cap": b"\x01" * (MAX_RELEASE_RUNS + 1),
            }
            for name, runs in cases.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    runner.run(call_once(release, hostile_release(real, runs)))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                assert err.value.details().startswith("runs:"), (name, err.value.details())
            pong = runner.run(ping(channel))
            assert pb.PingResponse.FromString(pong).payload == b"alive"
        finally:
            runner.run(channel.close())
            runner.run(server.stop(0.1))
