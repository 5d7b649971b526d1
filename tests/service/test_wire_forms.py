"""Wire forms (docs/api.md): one form of each value. A chain is ``packed_hashes``
or ``tokens``; replies are packed; malformed packed fields are INVALID_ARGUMENT
naming the field; the numbers of the forms dropped at 0.1.0 are ignored."""

from __future__ import annotations

import grpc
import pytest

from kvstore.api import wire
from kvstore.v1 import kvstore_pb2 as pb
from tests.inproc import BLOCK_BYTES, BLOCK_SIZE
from tests.replies import entries_of
from tests.service.calls import INVALID, field_of, pin, store
from tests.stand_ins import stand_in_checksums

TOKENS = list(range(7, 7 + 5 * BLOCK_SIZE + 1))  # 5 full blocks and a partial one


async def test_a_lookup_answers_in_the_one_packed_form(stub, namespace, lease):
    ns = namespace.id
    chain = await store(stub, ns, lease, TOKENS)
    by_tokens = await stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=TOKENS))
    assert by_tokens.hit_blocks == 5 and by_tokens.packed_chain == b"".join(chain)
    assert by_tokens.hit_hashes == b"".join(chain)
    slots = wire.unpack_u64(by_tokens.packed_slots, "packed_slots")
    generations = wire.unpack_u64(by_tokens.packed_generations, "packed_generations")
    checksums = wire.unpack_u64(by_tokens.packed_checksums, "packed_checksums")
    assert len(slots) == len(generations) == len(checksums) == 5
    assert len(set(slots.tolist())) == 5 and all(g > 0 for g in generations.tolist())
    assert (by_tokens.hit_tokens, by_tokens.query_tokens) == (5 * BLOCK_SIZE, len(TOKENS))
    assert by_tokens.block_bytes == BLOCK_BYTES and by_tokens.slots_per_arena
    by_hashes = await stub.Lookup(pb.LookupRequest(namespace_id=ns, packed_hashes=b"".join(chain)))
    assert by_hashes.hit_hashes == by_tokens.hit_hashes and not by_hashes.packed_chain
    assert by_hashes.packed_slots == by_tokens.packed_slots
    assert by_hashes.packed_generations == by_tokens.packed_generations
    assert by_hashes.query_tokens == 5 * BLOCK_SIZE


@pytest.mark.parametrize(
    ("method", "request_type", "dropped"),
    [
        # Numbers of 0.1.0's dropped forms, now reserved: a node ignores them.
        ("Lookup", pb.LookupRequest, 5),  # hashes
        ("Lookup", pb.LookupRequest, 9),  # packed_tokens
        ("Reserve", pb.ReserveRequest, 4),  # hashes
        ("Reserve", pb.ReserveRequest, 7),  # packed_tokens
    ],
)
async def test_a_dropped_chain_form_is_no_chain(
    stub, namespace, lease, method, request_type, dropped
):
    request_ = request_type(namespace_id=namespace.id, lease_id=lease)
    request_.MergeFromString(bytes([dropped << 3 | 2, 32]) + b"\x01" * 32)  # an unknown field
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await getattr(stub, method)(request_)
    assert err.value.code() == INVALID and "both are empty" in err.value.details()


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
    reserved = await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lease, tokens=TOKENS))
    assert list(reserved.statuses) == [pb.RESERVE_STATUS_RESERVED] * 5
    assert len(reserved.slots) == len(reserved.generations) == 5
    assert reserved.slots_per_arena and reserved.block_bytes == BLOCK_BYTES
    hashes = wire.unpack_hashes(reserved.hashes)
    # Abort the last block, commit the first four, all through packed_hashes.
    aborted = await stub.Abort(
        pb.AbortRequest(namespace_id=ns, lease_id=lease, packed_hashes=hashes[4])
    )
    committed = await stub.Commit(
        pb.CommitRequest(
            namespace_id=ns,
            lease_id=lease,
            packed_hashes=b"".join(hashes[:4]),
            packed_checksums=stand_in_checksums(b"".join(hashes[:4])),
        )
    )
    assert (aborted.aborted, committed.committed) == (1, 4)
    again = await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns, lease_id=lease, packed_hashes=reserved.hashes)
    )
    assert again.hashes == reserved.hashes
    assert list(again.statuses) == [pb.RESERVE_STATUS_HIT] * 4 + [pb.RESERVE_STATUS_RESERVED]
    # The four hits are where the committed blocks are.
    assert list(again.slots[:4]) == list(reserved.slots[:4])
    # Four HIT blocks and the fifth WRITING under this lease (reserved by `again`):
    # the same slots and generations again, read block by block.
    third = await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns, lease_id=lease, packed_hashes=reserved.hashes)
    )
    assert [e.status for e in entries_of(third)] == list(again.statuses)
    assert [e.location.slot for e in entries_of(third)] == list(again.slots)
    assert [e.location.generation for e in entries_of(third)] == list(again.generations)


@pytest.mark.parametrize(
    ("method", "request_", "field", "words"),
    [
        ("Lookup", pb.LookupRequest(packed_hashes=b"\x01" * 33), "packed_hashes", "33 bytes"),
        (
            "Lookup",
            pb.LookupRequest(tokens=[1], packed_hashes=b"\x01" * 32),
            "tokens",
            "not both",
        ),
        ("Lookup", pb.LookupRequest(packed_hashes=b"\x01" * 32 * 257), "packed_hashes", "257"),
        ("Reserve", pb.ReserveRequest(packed_hashes=b"\x01" * 31), "packed_hashes", "31 bytes"),
        (
            "Reserve",
            pb.ReserveRequest(tokens=[1] * (256 * BLOCK_SIZE + BLOCK_SIZE)),
            "tokens",
            "max_chain_blocks",
        ),
        ("Release", pb.ReleaseRequest(packed_hashes=b"\x01" * 40), "packed_hashes", "40 bytes"),
        ("Commit", pb.CommitRequest(packed_hashes=b"\x01" * 33), "packed_hashes", "33 bytes"),
        ("Abort", pb.AbortRequest(), "packed_hashes", "is empty"),
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
