"""Per-block views of the packed Lookup and Reserve replies, for assertions.

The wire carries one form of each reply (docs/api.md, "Wire forms"): the
hashes as one bytes field, slots and generations packed. Tests that check
block by block read them through these views instead of decoding by hand.
"""

from __future__ import annotations

from typing import NamedTuple

from kvstore.api import wire
from kvstore.v1 import kvstore_pb2 as pb


class Location(NamedTuple):
    """Where one block is, as a reply says (arena and offset from the pool's numbers)."""

    hash: bytes
    slot: int
    generation: int
    arena: int
    offset: int
    checksum: int = 0


class Entry(NamedTuple):
    """One block of a Reserve reply: its hash, status and location (slot 0 without one)."""

    hash: bytes
    status: int
    location: Location


def _place(slot: int, slots_per_arena: int, block_bytes: int) -> tuple[int, int]:
    arena, index = divmod(slot, slots_per_arena) if slots_per_arena else (0, 0)
    return arena, index * block_bytes


def blocks_of(resp: pb.LookupResponse) -> list[Location]:
    """The hit blocks of a Lookup reply, in chain order."""
    hashes = wire.unpack_hashes(resp.hit_hashes)
    slots = wire.unpack_u64(resp.packed_slots, "packed_slots").tolist()
    generations = wire.unpack_u64(resp.packed_generations, "packed_generations").tolist()
    checksums = wire.unpack_u64(resp.packed_checksums, "packed_checksums").tolist()
    return [
        Location(h, s, g, *_place(s, resp.slots_per_arena, resp.block_bytes), c)
        for h, s, g, c in zip(hashes, slots, generations, checksums, strict=True)
    ]


def chain_of(resp: pb.LookupResponse) -> list[bytes]:
    """Every full block's hash a Lookup that sent tokens answers (``packed_chain``)."""
    return list(wire.unpack_hashes(resp.packed_chain))


def entries_of(resp: pb.ReserveResponse) -> list[Entry]:
    """The entries of a Reserve reply, one per block of the chain."""
    hashes = wire.unpack_hashes(resp.hashes, "hashes")
    return [
        Entry(h, st, Location(h, s, g, *_place(s, resp.slots_per_arena, resp.block_bytes)))
        for h, st, s, g in zip(hashes, resp.statuses, resp.slots, resp.generations, strict=True)
    ]
