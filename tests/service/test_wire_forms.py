"""Wire forms (docs/api.md): the packed request fields and the packed replies
answer exactly what the per-block forms answer, and the per-block forms keep
working unchanged for clients that do not know the packed ones."""

from __future__ import annotations

import grpc
import pytest

from kvstore.api import wire
from kvstore.v1 import kvstore_pb2 as pb
from tests.inproc import BLOCK_BYTES, BLOCK_SIZE
from tests.service.calls import INVALID, field_of, pin, store

TOKENS = list(range(7, 7 + 5 * BLOCK_SIZE + 1))  # 5 full blocks and a partial one


async def test_old_and_packed_lookups_answer_the_same(stub, namespace, lease):
    ns = namespace.id
    chain = await store(stub, ns, lease, TOKENS)
    old = await stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=TOKENS))
    # The per-block reply, as before: no packed field is set.
    assert old.hit_blocks == 5 and len(old.blocks) == 5 and list(old.chain) == chain
    assert not old.hit_hashes and not old.slots and not old.packed_chain
    packed = await stub.Lookup(
        pb.LookupRequest(namespace_id=ns, packed_tokens=wire.pack_tokens(TOKENS), packed_reply=True)
    )
    assert not packed.blocks and not packed.chain
    assert packed.packed_chain == b"".join(chain)
    assert packed.hit_hashes == b"".join(b.hash for b in old.blocks)
    assert list(packed.slots) == [b.slot for b in old.blocks]
    assert list(packed.generations) == [b.generation for b in old.blocks]
    assert (packed.hit_blocks, packed.hit_tokens, packed.query_tokens) == (
        old.hit_blocks,
        old.hit_tokens,
        old.query_tokens,
    )
    assert packed.block_bytes == BLOCK_BYTES
    for slot, b in zip(packed.slots, old.blocks, strict=True):
        arena, index = divmod(slot, packed.slots_per_arena)
        assert (arena, index * packed.block_bytes) == (b.arena, b.offset)
    by_hashes = await stub.Lookup(
        pb.LookupRequest(namespace_id=ns, packed_hashes=b"".join(chain), packed_reply=True)
    )
    assert by_hashes.hit_hashes == packed.hit_hashes and not by_hashes.packed_chain
    assert by_hashes.query_tokens == 5 * BLOCK_SIZE


async def test_packed_pins_are_released_by_packed_hashes(stub, namespace, lease):
    ns = namespace.id
    chain = await store(stub, ns, lease, TOKENS)
    hit_hashes = await pin(stub, ns, lease, chain)
    assert (await stub.Stats(pb.StatsRequest())).pinned == 5
    released = await stub.Release(
        pb.ReleaseRequest(namespace_id=ns, lease_id=lease, packed_hashes=hit_hashes)
    )
    assert released.released == 5 and (await stub.Stats(pb.StatsRequest())).pinned == 0


async def test_packed_reserve_commit_and_abort(stub, namespace, lease):
    ns = namespace.id
    packed_tokens = wire.pack_tokens(TOKENS)
    reserved = await stub.Reserve(
        pb.ReserveRequest(
            namespace_id=ns, lease_id=lease, packed_tokens=packed_tokens, packed_reply=True
        )
    )
    assert not reserved.entries
    assert list(reserved.statuses) == [pb.RESERVE_STATUS_RESERVED] * 5
    assert len(reserved.slots) == len(reserved.generations) == 5
    assert reserved.slots_per_arena and reserved.block_bytes == BLOCK_BYTES
    hashes = wire.unpack_hashes(reserved.hashes)
    # Abort the last block, commit the first four, all through packed_hashes.
    aborted = await stub.Abort(
        pb.AbortRequest(namespace_id=ns, lease_id=lease, packed_hashes=hashes[4])
    )
    committed = await stub.Commit(
        pb.CommitRequest(namespace_id=ns, lease_id=lease, packed_hashes=b"".join(hashes[:4]))
    )
    assert (aborted.aborted, committed.committed) == (1, 4)
    # The old form answers the same chain with per-block entries.
    again = await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lease, tokens=TOKENS))
    assert [e.hash for e in again.entries] == hashes and not again.hashes
    assert [e.status for e in again.entries] == [pb.RESERVE_STATUS_HIT] * 4 + [
        pb.RESERVE_STATUS_RESERVED
    ]
    packed_again = await stub.Reserve(
        pb.ReserveRequest(
            namespace_id=ns, lease_id=lease, packed_hashes=reserved.hashes, packed_reply=True
        )
    )
    # Four HIT blocks and the fifth WRITING under this lease (reserved by `again`):
    # the packed reply says what the entries say.
    entries = await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lease, hashes=hashes))
    assert list(packed_again.statuses) == [e.status for e in entries.entries]
    assert list(packed_again.slots[:4]) == [e.location.slot for e in entries.entries[:4]]
    assert list(packed_again.generations[:4]) == [
        e.location.generation for e in entries.entries[:4]
    ]


@pytest.mark.parametrize(
    ("method", "request_", "field", "words"),
    [
        ("Lookup", pb.LookupRequest(packed_hashes=b"\x01" * 33), "packed_hashes", "33 bytes"),
        ("Lookup", pb.LookupRequest(packed_tokens=b"\x01" * 6), "packed_tokens", "6 bytes"),
        (
            "Lookup",
            pb.LookupRequest(packed_hashes=b"\x01" * 32, hashes=[b"\x01" * 32]),
            "packed_hashes",
            "not both",
        ),
        (
            "Lookup",
            pb.LookupRequest(packed_tokens=b"\x01" * 4, tokens=[1]),
            "packed_tokens",
            "not both",
        ),
        (
            "Lookup",
            pb.LookupRequest(packed_tokens=b"\x01" * 4, packed_hashes=b"\x01" * 32),
            "tokens",
            "not both",
        ),
        ("Lookup", pb.LookupRequest(packed_hashes=b"\x01" * 32 * 257), "packed_hashes", "257"),
        ("Reserve", pb.ReserveRequest(packed_hashes=b"\x01" * 31), "packed_hashes", "31 bytes"),
        (
            "Reserve",
            pb.ReserveRequest(packed_tokens=b"\x01" * 4 * (256 * BLOCK_SIZE + BLOCK_SIZE)),
            "tokens",
            "max_chain_blocks",
        ),
        ("Release", pb.ReleaseRequest(packed_hashes=b"\x01" * 40), "packed_hashes", "40 bytes"),
        ("Commit", pb.CommitRequest(packed_hashes=b"\x01" * 33), "packed_hashes", "33 bytes"),
        (
            "Abort",
            pb.AbortRequest(packed_hashes=b"\x01" * 32, hashes=[b"\x01" * 32]),
            "packed_hashes",
            "not both",
        ),
    ],
)
async def test_malformed_packed_fields_are_invalid_argument(
    stub, namespace, lease, method, request_, field, words
):
    request_.namespace_id = namespace.id
    request_.lease_id = lease
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await getattr(stub, method)(request_)
    assert err.value.code() == INVALID, err.value.details()
    assert words in err.value.details() and field_of(err.value) == field
    assert (await stub.Ping(pb.PingRequest(payload=b"ok"))).payload == b"ok"


async def test_query_tokens_counts_the_partial_block_of_hashes_sent(stub, namespace, lease):
    # A client that hashed the prompt itself (the SDK does) says how many
    # tokens it had: the node counts them as if they had been sent.
    ns = namespace.id
    chain = await store(stub, ns, lease, TOKENS)  # 5 full blocks and 1 more token
    by_hashes = pb.LookupRequest(
        namespace_id=ns, packed_hashes=b"".join(chain), query_tokens=len(TOKENS)
    )
    hit = await stub.Lookup(by_hashes)
    by_tokens = await stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=TOKENS))
    assert (hit.hit_tokens, hit.query_tokens) == (by_tokens.hit_tokens, by_tokens.query_tokens)
    assert hit.query_tokens == 5 * BLOCK_SIZE + 1
    for bad in (5 * BLOCK_SIZE - 1, 6 * BLOCK_SIZE):  # not 5 full blocks and a partial one
        by_hashes.query_tokens = bad
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Lookup(by_hashes)
        assert err.value.code() == INVALID and field_of(err.value) == "query_tokens"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=TOKENS, query_tokens=81))
    assert err.value.code() == INVALID and field_of(err.value) == "query_tokens"
