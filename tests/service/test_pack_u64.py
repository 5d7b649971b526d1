"""``LookupResponse.packed_slots`` / ``packed_generations``: little-endian uint64 bytes
(docs/api.md, "Wire forms")."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from kvstore.api import wire
from kvstore.errors import InvalidArgument


def test_pack_u64_is_little_endian_and_unpack_checks_the_length():
    values = array("q", [1, 2, 1 << 40])
    packed = wire.pack_u64(values)
    assert packed == b"".join(v.to_bytes(8, "little") for v in values)
    assert wire.unpack_u64(packed, "packed_slots").dtype == np.uint64
    with pytest.raises(InvalidArgument, match="packed_slots is 7 bytes"):
        wire.unpack_u64(packed[:7], "packed_slots")
