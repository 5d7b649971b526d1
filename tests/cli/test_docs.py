"""The operator docs say what the code does: `kvstore nodes --json` fields, the
`salt_secret` minimum, the errors for malformed and unknown namespace ids."""

from __future__ import annotations

import json
import re

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from service.cluster.registry import NodeInfo
from service.config.values import parse_secret
from tests.cli.docs import documented_node_fields, text


def test_nodes_json_fields_are_documented():
    written = json.loads(NodeInfo(node_id="n", address="h:1").to_json())
    fields = documented_node_fields()
    assert set(fields) == set(written) | {"expires_in_seconds"}
    page = text("operations.md")
    paragraph = page[page.index("**`kvstore nodes --json`.**") :][:1200]
    for name in fields:
        assert f"`{name}`" in paragraph, name


def test_salt_secret_minimum_is_documented():
    page = text("security.md")
    [minimum] = {int(n) for n in re.findall(r"`salt_secret`.{0,200}?at least (\d+) bytes", page)}
    assert parse_secret("ab" * minimum) == b"\xab" * minimum
    with pytest.raises(ValueError) as info:
        parse_secret("ab" * (minimum - 1))
    said = str(info.value)
    assert said == f"a salt secret needs at least {minimum} bytes, got {minimum - 1}"
    assert said.rsplit(" ", 1)[0] in page  # the message, as quoted (with N for the count)


def test_namespace_id_errors_are_documented(live_node):
    page = text("operations.md")
    channel, stub = live_node.stub()
    with channel:
        with pytest.raises(grpc.RpcError) as info:
            stub.ListBlocks(pb.ListBlocksRequest(namespace_id="demo-model"), timeout=5)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"`{info.value.details()}`" in page
        with pytest.raises(grpc.RpcError) as info:
            stub.ListBlocks(pb.ListBlocksRequest(namespace_id="0" * 16), timeout=5)
        assert info.value.code() is grpc.StatusCode.NOT_FOUND
        assert info.value.details() == f"namespace {'0' * 16!r} is not registered on this node"
        assert "`namespace '…' is not registered on this node`" in page
