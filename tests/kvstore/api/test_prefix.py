"""The prefix-query answer's one type: its protobuf and JSON forms."""

from __future__ import annotations

from kvstore.api.prefix import NODE_TIER, SOURCE_LOCAL, PrefixAnswer, PrefixHolder
from kvstore.v1 import kvstore_pb2 as pb

POOL = PrefixHolder("n1", "10.0.0.1:50051", NODE_TIER, "", 3, 48)
ENGINE = PrefixHolder("n2", "", "GPU", "vllm-0", 2, 32)
ANSWER = PrefixAnswer(
    namespace_id="ns1",
    model="m",
    tenant_id="t",
    block_size=16,
    query_blocks=4,
    query_tokens=70,
    source=SOURCE_LOCAL,
    holders=(POOL, ENGINE),
)


def test_proto_round_trip() -> None:
    wire = ANSWER.to_proto()
    assert wire.longest_matched == 48
    again = pb.QueryPrefixResponse.FromString(wire.SerializeToString())
    assert PrefixAnswer.from_proto(again) == ANSWER


def test_longest_matched_follows_the_holders() -> None:
    empty = PrefixAnswer("ns1", "m", "t", 16, 4, 64, SOURCE_LOCAL)
    assert empty.longest_matched == 0
    assert empty.to_proto().longest_matched == 0
    assert PrefixAnswer.from_proto(empty.to_proto()) == empty
    assert ANSWER.longest_matched == 48


def test_json_names_every_field() -> None:
    assert ANSWER.to_json() == {
        "model": "m",
        "namespace_id": "ns1",
        "tenant_id": "t",
        "block_size": 16,
        "query_blocks": 4,
        "query_tokens": 70,
        "longest_matched": 48,
        "source": "local",
        "holders": [
            {
                "node_id": "n1",
                "address": "10.0.0.1:50051",
                "tier": "kvstore",
                "engine": "",
                "matched_blocks": 3,
                "matched_tokens": 48,
            },
            {
                "node_id": "n2",
                "address": "",
                "tier": "GPU",
                "engine": "vllm-0",
                "matched_blocks": 2,
                "matched_tokens": 32,
            },
        ],
    }
