"""The typed RPC table matches the service the proto declares, entry for entry."""

from __future__ import annotations

import re

from kvstore.client import methods
from kvstore.client.methods import ClientStream, ServerStream, Unary
from kvstore.v1 import kvstore_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]


def table() -> dict[str, Unary | ServerStream | ClientStream]:
    entries = {
        k: v for k, v in vars(methods).items() if isinstance(v, Unary | ServerStream | ClientStream)
    }
    for constant, entry in entries.items():  # LOOKUP for "Lookup", OPEN_LEASE for "OpenLease"
        assert constant == re.sub(r"(?<!^)(?=[A-Z])", "_", entry.name).upper(), constant
    by_name = {m.name: m for m in entries.values()}
    assert len(by_name) == len(entries), "an RPC has two constants"
    return by_name


def test_every_rpc_has_one_typed_constant():
    assert sorted(table()) == sorted(m.name for m in SERVICE.methods)


def test_each_constant_has_the_rpcs_messages_and_streaming():
    entries = table()
    for rpc in SERVICE.methods:
        entry = entries[rpc.name]
        assert entry.request.DESCRIPTOR is rpc.input_type, rpc.name
        assert entry.reply.DESCRIPTOR is rpc.output_type, rpc.name
        kind = {
            (False, False): Unary,
            (False, True): ServerStream,
            (True, False): ClientStream,
        }[(rpc.client_streaming, rpc.server_streaming)]
        assert type(entry) is kind, rpc.name
