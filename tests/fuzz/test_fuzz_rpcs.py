"""Hypothesis-generated requests against every RPC of a live node.

Each example is one call: a method of the KVStore service (unary, server-
or client-streaming) and a request whose every field is drawn from its
protobuf type (huge and zero numbers, NaN and infinite floats, random
strings, random bytes of random lengths, long repeated fields, unknown enum
values), often mixed with real values (the registered namespace, a live
lease, real chain hashes and block locations) so the calls get past the
first checks into the core; the call carries random tenant metadata.

The node must never answer ``UNKNOWN`` or ``INTERNAL`` (a client's mistake
is a precise status code), never log a bug, keep answering Ping, and keep
its invariants: after every lease is closed no pin and no WRITING slot is
left, and every namespace accounts for all its slots.

``KVSTORE_FUZZ_EXAMPLES`` sets the number of calls (default 2000).
"""

from __future__ import annotations

import asyncio
import logging
import os
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.server import Server
from tests.fuzz.node import LAYOUT, config
from tests.replies import Location, blocks_of, chain_of, entries_of
from tests.stand_ins import stand_in_checksums

EXAMPLES = int(os.environ.get("KVSTORE_FUZZ_EXAMPLES", "2000"))

SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
METHODS = sorted(m.name for m in SERVICE.methods)

FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
"""Codes that a client's input must never produce."""

CALL_TIMEOUT = 5.0
"""A call that takes longer is a hang (a bug) except WatchEvents, which streams forever."""


@dataclass
class Real:
    """Real values of the node under test, mixed into the generated requests."""

    namespace_id: str = ""
    lease_ids: list[int] = field(default_factory=list)
    chain: list[bytes] = field(default_factory=list)
    locations: list[Location] = field(default_factory=list)
    opened: set[int] = field(default_factory=set)
    """Every lease the fuzzer's OpenLease calls got (closed at the end)."""


REAL = Real()

# --- strategies from protobuf descriptors ------------------------------------------

BIG = [0, 1, 2, 3, 4, 15, 16, 255, 256, 1023, 1024, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1]


def _ints(bits: int, signed: bool) -> st.SearchStrategy[int]:
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    edges = [v for v in [*BIG, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**31)] if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi), st.integers(0, 300))


TEXT = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=string.printable, max_size=12),
    st.just(""),
    st.text(min_size=1000, max_size=5000),
)
BYTES = st.one_of(
    st.binary(max_size=40),
    st.binary(min_size=32, max_size=32),
    st.just(b""),
    st.binary(min_size=1000, max_size=70_000),
)


def _real_or(name: str, fallback: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Values of fields whose name says what they are: real ones, half the time."""
    if name == "namespace_id":
        return st.one_of(st.builds(lambda: REAL.namespace_id), fallback)
    if name == "lease_id":
        return st.one_of(
            st.builds(lambda: REAL.lease_ids[0] if REAL.lease_ids else 0),
            st.builds(lambda: next(iter(REAL.opened), 0)),
            fallback,
        )
    if name in ("hashes", "hash", "parent"):
        return st.one_of(
            st.builds(lambda: list(REAL.chain) if name == "hashes" else REAL.chain[0]), fallback
        )
    if name == "packed_hashes":  # the chain's one wire form
        return st.one_of(st.builds(lambda: b"".join(REAL.chain)), fallback)
    if name == "tenant":
        return st.one_of(st.sampled_from(["default", "acme", ""]), fallback)
    if name == "layout":
        return st.one_of(st.just(LAYOUT), fallback)
    return fallback


def _scalar(fd: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    t = fd.type
    if t == FieldDescriptor.TYPE_MESSAGE:
        return messages(fd.message_type, depth + 1)
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return _ints(32, False)
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return _ints(64, False)
    if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return _ints(32, True)
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return _ints(64, True)
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.one_of(
            st.floats(allow_nan=True, allow_infinity=True, width=64),
            st.sampled_from([0.0, -1.0, 0.5, 1.0, 30.0, 1e308, 5e-324]),
        )
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return TEXT
    if t == FieldDescriptor.TYPE_BYTES:
        return BYTES
    if t == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in fd.enum_type.values]
        return st.one_of(st.sampled_from(known), _ints(32, True))  # open enums: unknown too
    raise AssertionError(f"no strategy for field type {t} of {fd.full_name}")


def _field(fd: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if fd.is_repeated:
        item = _scalar(fd, depth)
        sizes = st.sampled_from([0, 1, 2, 5, 16, 64, 300])
        many = sizes.flatmap(lambda n: st.lists(item, min_size=min(n, 3), max_size=n))
        return _real_or(fd.name, many)
    return _real_or(fd.name, _scalar(fd, depth))


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Messages of ``descriptor`` with a random subset of fields set to random values."""
    cls = _message_class(descriptor)
    if depth > 2:
        return st.builds(cls)
    fields = {fd.name: st.one_of(st.none(), _field(fd, depth)) for fd in descriptor.fields}

    def build(values: dict[str, Any]) -> Any:
        msg = cls()
        for name, value in values.items():
            if value is None:
                continue
            fd = descriptor.fields_by_name[name]
            try:
                if fd.is_repeated:
                    if fd.type == FieldDescriptor.TYPE_MESSAGE:
                        getattr(msg, name).extend(value)
                    else:
                        getattr(msg, name)[:] = value
                elif fd.type == FieldDescriptor.TYPE_MESSAGE:
                    getattr(msg, name).CopyFrom(value)
                else:
                    setattr(msg, name, value)
            except (ValueError, TypeError):
                pass  # e.g. an unknown value of a closed field type: leave it unset
        return msg

    return st.fixed_dictionaries(fields).map(build)


def _message_class(descriptor: Descriptor) -> Any:
    return getattr(pb, descriptor.name)


METADATA = st.lists(
    st.tuples(
        st.sampled_from(["x-kvstore-tenant", "authorization", "x-kvstore-admin", "x-other"]),
        st.text(alphabet=string.ascii_letters + string.digits + " -_.:/", max_size=30),
    ),
    max_size=3,
)


@st.composite
def calls(draw: Callable[..., Any]) -> tuple[str, Any, tuple[tuple[str, str], ...]]:
    """(method, request or list of stream items, metadata)."""
    method = draw(st.sampled_from(METHODS))
    desc = SERVICE.methods_by_name[method]
    if desc.client_streaming:
        header = pb.WriteBlocksRequest(header=draw(messages(pb.WriteBlocksHeader.DESCRIPTOR)))
        items = draw(st.lists(messages(desc.input_type), max_size=6))
        request: Any = ([header] if draw(st.booleans()) else []) + items
    else:
        request = draw(messages(desc.input_type))
    return method, request, tuple(draw(METADATA))


# --- the node and the calls ----------------------------------------------------------


async def invoke(stub: Any, method: str, request: Any, metadata: Any) -> grpc.StatusCode:
    desc = SERVICE.methods_by_name[method]
    call = getattr(stub, method)
    timeout = 0.3 if method == "WatchEvents" else CALL_TIMEOUT
    try:
        if desc.server_streaming:
            stream = call(request, timeout=timeout, metadata=metadata)
            async for _ in stream:
                if method == "WatchEvents":
                    stream.cancel()
                    return grpc.StatusCode.CANCELLED
        elif desc.client_streaming:
            await call(iter(request), timeout=timeout, metadata=metadata)
        else:
            resp = await call(request, timeout=timeout, metadata=metadata)
            if method == "OpenLease":
                REAL.opened.add(resp.lease_id)
    except grpc.aio.AioRpcError as err:
        code = err.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and method == "WatchEvents":
            return grpc.StatusCode.OK  # it waited for events, as it should
        return code
    return grpc.StatusCode.OK


async def setup_real(stub: Any) -> None:
    resp = await stub.RegisterNamespace(
        pb.RegisterNamespaceRequest(model_id="fuzz-model", layout=LAYOUT), timeout=5
    )
    REAL.namespace_id = resp.namespace_id
    lease = (await stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=600), timeout=5)).lease_id
    REAL.lease_ids = [lease]
    tokens = list(range(1, 33))  # 8 blocks
    res = await stub.Reserve(
        pb.ReserveRequest(namespace_id=REAL.namespace_id, lease_id=lease, tokens=tokens[:16]),
        timeout=5,
    )
    await stub.Commit(
        pb.CommitRequest(
            namespace_id=REAL.namespace_id,
            lease_id=lease,
            packed_hashes=b"".join([e.hash for e in entries_of(res)]),
            packed_checksums=stand_in_checksums(b"".join([e.hash for e in entries_of(res)])),
        ),
        timeout=5,
    )
    hit = await stub.Lookup(
        pb.LookupRequest(namespace_id=REAL.namespace_id, lease_id=lease, pin=True, tokens=tokens),
        timeout=5,
    )
    REAL.chain = chain_of(hit)
    REAL.locations = blocks_of(hit)


def test_random_requests_never_crash_the_node_or_break_its_invariants(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    tried: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    bad: list[str] = []
    with asyncio.Runner() as runner:
        server = Server(config(tmp_path), expiry_tick=0.05)
        runner.run(server.start())
        channel = grpc.aio.insecure_channel(
            server.address, options=[("grpc.max_receive_message_length", 8 << 20)]
        )
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        try:
            runner.run(setup_real(stub))

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(calls())
            def one_call(call: tuple[str, Any, Any]) -> None:
                method, request, metadata = call
                code = runner.run(invoke(stub, method, request, metadata))
                tried[method] += 1
                codes[code.name] += 1
                if code in FORBIDDEN or (
                    code == grpc.StatusCode.DEADLINE_EXCEEDED and method != "WatchEvents"
                ):
                    bad.append(f"{method} -> {code.name}: {request!r:.300} {metadata}")
                assert not bad, bad[-1]

            one_call()
            print(f"fuzz: {sum(tried.values())} calls, per method {dict(sorted(tried.items()))}")
            print(f"fuzz: status codes {dict(sorted(codes.items()))}")
            assert set(tried) == set(METHODS), f"methods never tried: {set(METHODS) - set(tried)}"
            runner.run(check_invariants(stub))
        finally:
            runner.run(channel.close())
            runner.run(server.stop(0.1))
    bugs = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert bugs == [], f"the node logged errors for client input: {bugs[:5]}"


async def check_invariants(stub: Any) -> None:
    pong = await stub.Ping(pb.PingRequest(payload=b"still here"), timeout=5)
    assert pong.payload == b"still here"
    for lease_id in {*REAL.lease_ids, *REAL.opened}:
        try:
            await stub.CloseLease(pb.CloseLeaseRequest(lease_id=lease_id), timeout=5)
        except grpc.aio.AioRpcError as err:  # closed or expired meanwhile
            assert err.code() in {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND}
    # Leases opened with another tenant's metadata stay theirs; the store expires them.
    stats = await stub.Stats(pb.StatsRequest(), timeout=5)
    for ns in stats.namespaces:
        assert ns.free + ns.quarantined + ns.ready + ns.writing == ns.capacity, ns
        assert ns.pinned <= ns.ready, ns
    assert sum(ns.writing for ns in stats.namespaces) == stats.writing
    if stats.leases == 0:
        assert (stats.pinned, stats.writing) == (0, 0), stats
