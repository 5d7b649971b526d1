"""The SDK's wire forms: packed requests, and a `Hit` that keeps the packed reply
and builds per-block locations only when asked (docs/api.md, "Wire forms")."""

from __future__ import annotations

import json
from array import array
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.api import wire
from kvstore.client import Client
from kvstore.client.replies import chain_fields, hit_from_proto
from kvstore.errors import InvalidArgument
from kvstore.results import MissReason
from kvstore.types import BlockHash, LeaseId
from kvstore.v1 import kvstore_pb2 as pb
from tests.client.blocks import LAYOUT
from tests.replies import blocks_of, chain_of

TOKENS = list(range(500, 500 + 4 * 6 + 1))
"""Six full blocks and a partial one."""


def block(i: int) -> np.ndarray:
    return np.full(LAYOUT.block_shape, i + 0.25, np.float16)


async def test_lookup_is_packed_and_its_hit_lazy(kv: Client, monkeypatch) -> None:
    ns = await kv.register_namespace("wire", LAYOUT)
    await kv.store(ns, TOKENS, [block(i) for i in range(6)])
    sent: list[Any] = []
    call = kv._rpc.call

    async def spy(method: str, request: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(request)
        return await call(method, request, *args, **kwargs)

    monkeypatch.setattr(kv._rpc, "call", spy)
    hit = await kv.lookup(ns, TOKENS, pin=True)
    lookup = sent[-1]
    # The SDK hashes the prompt itself and sends the chain, with the token count.
    assert lookup.packed_hashes == b"".join(ns.hash(TOKENS))
    assert lookup.query_tokens == len(TOKENS)
    assert not lookup.tokens
    assert (hit.hit_tokens, hit.query_tokens) == (24, 25)  # as if the node had hashed them
    assert hit._blocks is None and hit._chain is None  # nothing built yet
    for i, view in enumerate(hit.numpy_views()):
        assert np.array_equal(view, block(i))
    assert hit._blocks is None  # views come from the slot array
    assert hit.chain == tuple(ns.hash(TOKENS)) and hit.hashes == list(hit.chain)

    # The node's reply, read block by block, is what the hit's locations say.
    raw = await call(
        "Lookup", pb.LookupRequest(namespace_id=ns.id, tokens=TOKENS), None, idempotent=True
    )
    assert [(b.hash, b.slot, b.generation, b.arena, b.offset) for b in blocks_of(raw)] == [
        (b.hash, b.slot, b.generation, b.arena, b.offset) for b in hit.blocks
    ]
    assert chain_of(raw) == list(hit.chain)
    assert await kv.release(hit) == 6
    assert sent[-1].packed_hashes == hit.hit_hashes

    miss = await kv.lookup(ns, [9] * 9, pin=True)
    assert (miss.hit_blocks, miss.blocks, miss.hashes, miss.slots.size) == (0, (), [], 0)
    assert len(miss.chain) == 2 and miss.miss_reason is MissReason.ABSENT
    assert await kv.release(miss) == 0

    by_hashes = await kv.lookup(ns, hashes=list(hit.chain))
    assert sent[-1].packed_hashes == b"".join(hit.chain) and not sent[-1].tokens
    assert by_hashes.hit_blocks == 6 and by_hashes.chain == ()


def test_a_packed_reply_builds_locations_on_first_access() -> None:
    h = [bytes([i]) * 31 + b"\0" for i in range(3)]  # trailing NULs are kept
    resp = pb.LookupResponse(
        hit_blocks=3,
        hit_hashes=b"".join(h),
        packed_slots=_u64([0, 17, 33]),
        packed_generations=_u64([1, 2, 3]),
        packed_checksums=_u64([0, 0, 9]),
        slots_per_arena=16,
        block_bytes=256,
        packed_chain=b"".join(h),
    )
    hit = hit_from_proto(_namespace(), resp, 0, LeaseId(0))
    assert hit._blocks is None and hit.lease_id is None
    assert [(b.hash, b.slot, b.generation, b.arena, b.offset) for b in hit.blocks] == [
        (h[0], 0, 1, 0, 0),
        (h[1], 17, 2, 1, 256),
        (h[2], 33, 3, 2, 256),
    ]
    assert hit.blocks is hit.blocks and hit.refs is hit.blocks  # built once
    assert hit.chain == tuple(h) and hit.hashes == h
    assert hit.checksums.tolist() == [0, 0, 9]


def _u64(values: list[int]) -> bytes:
    return wire.pack_u64(array("Q", values))


@pytest.mark.parametrize(
    "fields",
    [
        {"hit_hashes": b"\x01" * 64, "packed_slots": _u64([1]), "packed_generations": _u64([1])},
        {"hit_hashes": b"\x01" * 32, "packed_slots": _u64([1]), "packed_generations": _u64([])},
        # Every hit block has a checksum (0: none was sent).
        {"hit_hashes": b"\x01" * 32, "packed_slots": _u64([1]), "packed_generations": _u64([1])},
    ],
)
def test_an_inconsistent_reply_is_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument, match="inconsistent"):
        hit_from_proto(_namespace(), pb.LookupResponse(**fields), 0, LeaseId(0))


def test_chain_fields_pack_and_check() -> None:
    assert chain_fields([1, 2], None, None) == {"tokens": [1, 2]}
    assert chain_fields(np.array([1, 2], np.int64), None, None) == {"tokens": [1, 2]}
    assert chain_fields(None, [b"\x01" * 32], None) == {"packed_hashes": b"\x01" * 32}
    with pytest.raises(InvalidArgument, match=r"hashes\[1\] is 31 bytes"):
        chain_fields(None, [b"\x01" * 32, b"\x02" * 31], None)
    with pytest.raises(InvalidArgument, match="token ids"):
        chain_fields([1, -1], None, None)
    with pytest.raises(InvalidArgument, match="token ids"):
        chain_fields([2**32], None, None)


def _namespace() -> Any:
    from kvstore.client.handles import Namespace
    from kvstore.layout import NamespaceSpec

    return Namespace(
        spec=NamespaceSpec("m", LAYOUT),
        id="0123456789abcdef",  # type: ignore[arg-type]
        block_bytes=256,
        capacity=64,
        chain_root=BlockHash(bytes(32)),
        shared=False,
    )


def test_the_wire_benchmark_runs(capsys) -> None:
    from benchmarks import bench_wire

    bench_wire.main(["--quick", "--blocks", "8"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["blocks"] == 8 and doc["chain_tokens"] == 128
    for mode in ("hashes", "tokens"):
        assert doc[mode]["us"] > 0


@given(st.lists(st.binary(min_size=32, max_size=32), max_size=40))
def test_packed_hashes_round_trip(hashes: list[bytes]) -> None:
    assert wire.unpack_hashes(wire.pack_hashes(hashes)) == hashes


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200))
def test_packed_tokens_round_trip(tokens: list[int]) -> None:
    packed = wire.pack_tokens(tokens)
    assert packed == np.array(tokens, dtype="<u4").tobytes()
    assert wire.unpack_tokens(packed).tolist() == tokens


@given(st.binary(max_size=100).filter(lambda b: len(b) % 32 != 0))
def test_packed_hashes_of_a_bad_length_are_refused(packed: bytes) -> None:
    with pytest.raises(InvalidArgument, match="not a whole number"):
        wire.unpack_hashes(packed)
