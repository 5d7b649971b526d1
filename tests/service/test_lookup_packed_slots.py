"""``LookupRequest.packed_slots``: slots and generations as little-endian uint64 bytes,
the same values the repeated fields carry (docs/api.md, "Wire forms")."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from kvstore.api import wire
from kvstore.errors import InvalidArgument
from kvstore.v1 import kvstore_pb2 as pb
from tests.inproc import BLOCK_SIZE
from tests.service.calls import store


async def test_packed_slots_answer_what_the_repeated_fields_do(stub, namespace, lease):
    ns = namespace.id
    chain = await store(stub, ns, lease, list(range(1, 1 + 5 * BLOCK_SIZE)))
    base = dict(namespace_id=ns, packed_hashes=b"".join(chain), packed_reply=True)
    repeated = await stub.Lookup(pb.LookupRequest(**base))
    packed = await stub.Lookup(pb.LookupRequest(**base, packed_slots=True))
    assert packed.hit_blocks == repeated.hit_blocks == 5
    assert not packed.slots and not packed.generations  # not both forms
    assert len(packed.packed_slots) == len(packed.packed_generations) == 5 * wire.U64_BYTES
    assert wire.unpack_u64(packed.packed_slots, "s").tolist() == list(repeated.slots)
    assert wire.unpack_u64(packed.packed_generations, "g").tolist() == list(repeated.generations)
    assert packed.hit_hashes == repeated.hit_hashes
    # Without packed_reply the flag changes nothing: the per-block reply, as before.
    old = await stub.Lookup(pb.LookupRequest(namespace_id=ns, hashes=chain, packed_slots=True))
    assert len(old.blocks) == 5 and not old.packed_slots


def test_pack_u64_is_little_endian_and_unpack_checks_the_length():
    values = array("q", [1, 2, 1 << 40])
    packed = wire.pack_u64(values)
    assert packed == b"".join(v.to_bytes(8, "little") for v in values)
    assert wire.unpack_u64(packed, "packed_slots").dtype == np.uint64
    with pytest.raises(InvalidArgument, match="packed_slots is 7 bytes"):
        wire.unpack_u64(packed[:7], "packed_slots")
