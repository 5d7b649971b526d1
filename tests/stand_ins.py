"""Stand-ins for what a real writer sends, for tests that never write a block's bytes."""

from __future__ import annotations

from kvstore.checksum import pack_checksums
from kvstore.types import HASH_BYTES


def stand_in_checksums(packed_hashes: bytes) -> bytes:
    """``packed_checksums`` for blocks whose bytes a test neither writes nor reads back.

    A host pool's Commit needs a non-zero checksum per block (issue 40, item 3);
    these claim nothing about the bytes, so no test that uses them may check
    the bytes of those blocks.
    """
    return pack_checksums([1] * (len(packed_hashes) // HASH_BYTES))
