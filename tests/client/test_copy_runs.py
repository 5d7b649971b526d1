"""Copies between the caller's arrays and a host pool, one run of adjacent slots at a time.

`_copy_in` (what `Client.store` does through the mapping) and `Hit.copy_into`
(loading a hit) copy a run of adjacent slots of one arena with one copy;
these tests check the bytes land where the slots say, also for runs that
stop at an arena's end, slots out of order, chain positions skipped (hits)
and every kind of block supplier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import transfer
from kvstore.client.blocks import slot_runs
from kvstore.client.hit import BlockLocation, Hit
from kvstore.client.replies import Reservation, reservation_from_proto
from kvstore.client.transfer import _copy_in
from kvstore.errors import FailedPrecondition, InvalidArgument, LeaseExpired
from kvstore.pool import HostMapping, HostPool
from kvstore.results import MissReason
from kvstore.stamps import stamp_ident
from kvstore.types import BlockHash, NamespaceId, SlotId
from kvstore.v1 import kvstore_pb2 as pb
from tests.client.blocks import LAYOUT

BB = LAYOUT.block_bytes
SPA = 4
"""Slots per arena: 10 slots are arenas of 4, 4 and 2."""


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[HostPool, HostMapping]]:
    p = HostPool.create(
        NamespaceId("00112233aabbccdd"), BB, 10, 7, directory=str(tmp_path), arena_bytes=SPA * BB
    )
    mapping = HostMapping.open(p.descriptor)
    yield p, mapping
    mapping.close()
    p.close()


class _Ns:
    def __init__(self, mapping: HostMapping) -> None:
        self.mapping = mapping
        self.layout = LAYOUT
        self.verify_loads = True  # the node default (verify_checksums = "all")


def _reserved(pairs: list[tuple[int, int]]) -> Reservation:
    """(chain index, slot) pairs as Reserve answers them; other chain indexes are hits."""
    n = max(index for index, _ in pairs) + 1
    slots = dict(pairs)
    hashes = [bytes([i]) * 32 for i in range(n)]
    status = [pb.RESERVE_STATUS_RESERVED if i in slots else pb.RESERVE_STATUS_HIT for i in range(n)]
    resp = pb.ReserveResponse(
        hashes=b"".join(hashes),
        statuses=status,
        slots=[slots.get(i, 0) for i in range(n)],
        generations=[1] * n,
        slots_per_arena=SPA,
        block_bytes=BB,
    )
    return reservation_from_proto(resp)


def _blocks(n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    return rng.integers(0, 256, size=(n, *LAYOUT.block_shape), dtype=np.uint16)


def test_runs_break_at_gaps_and_at_arena_ends() -> None:
    assert slot_runs([], [], SPA) == [0]
    # slots 2,3 | 4,5 (arena 1 starts at 4) | 9 (gap) | 1 (backwards)
    assert slot_runs([2, 3, 4, 5, 9, 1], range(6), SPA) == [0, 2, 4, 5, 6]
    # adjacent slots but a skipped chain position (a hit between) also ends a run
    assert slot_runs([0, 1, 2], [0, 1, 3], SPA) == [0, 2, 3]


# Chain index -> slot: runs that cross arena ends, go backwards, skip chain positions.
PAIRS = [(0, 2), (1, 3), (2, 4), (3, 5), (4, 6), (6, 7), (7, 8), (8, 9), (9, 0)]


@pytest.mark.parametrize("supplier", ["array", "list", "callable", "bytes"])
def test_store_copies_land_in_their_slots(
    pool: tuple[HostPool, HostMapping], supplier: str
) -> None:
    node, mapping = pool
    blocks = _blocks(10)
    given: object = {
        "array": blocks,
        "list": list(blocks),
        "callable": lambda i: blocks[i],
        "bytes": [b.tobytes() for b in blocks],
    }[supplier]
    checks = 0

    def lease_alive() -> None:
        nonlocal checks
        checks += 1

    _copy_in(_Ns(mapping), _reserved(PAIRS), given, lease_alive)  # type: ignore[arg-type]
    for index, slot in PAIRS:
        assert node.read(SlotId(slot)) == blocks[index].tobytes(), (index, slot)
    assert node.read(SlotId(1)) == bytes(BB)  # chain index 5 was a hit: nothing written
    # The lease is checked before every copy: per run for one array, else per block.
    assert checks == (5 if supplier == "array" else len(PAIRS))


def test_an_expired_lease_stops_the_next_run(pool: tuple[HostPool, HostMapping]) -> None:
    node, mapping = pool
    blocks = _blocks(10)
    checks = 0

    def lease_alive() -> None:
        nonlocal checks
        checks += 1
        if checks == 2:
            raise LeaseExpired("lapsed")

    with pytest.raises(LeaseExpired):
        _copy_in(_Ns(mapping), _reserved(PAIRS), blocks, lease_alive)  # type: ignore[arg-type]
    assert node.read(SlotId(2)) == blocks[0].tobytes()  # run 1 (slots 2, 3) written
    assert node.read(SlotId(3)) == blocks[1].tobytes()
    for slot in (4, 5, 6, 7, 8, 9, 0):
        assert node.read(SlotId(slot)) == bytes(BB), slot


def test_wrong_blocks_are_refused_as_before(pool: tuple[HostPool, HostMapping]) -> None:
    _, mapping = pool
    ns = _Ns(mapping)
    wide = np.zeros((10, BB + 2), dtype=np.uint8)  # rows are not blocks: per block, refused
    with pytest.raises(InvalidArgument, match="bytes"):
        _copy_in(ns, _reserved(PAIRS), wide, lambda: None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="missing"):
        _copy_in(ns, _reserved(PAIRS), _blocks(5), lambda: None)  # type: ignore[arg-type]


def test_a_reply_placing_slots_elsewhere_than_the_mapping_writes_nothing(
    pool: tuple[HostPool, HostMapping],
) -> None:
    node, mapping = pool
    ns = _Ns(mapping)
    reserved = _reserved(PAIRS)
    other_arenas = dataclasses.replace(reserved, slots_per_arena=SPA * 2)
    with pytest.raises(FailedPrecondition, match="pool changed"):
        _copy_in(ns, other_arenas, _blocks(10), lambda: None)  # type: ignore[arg-type]
    other_blocks = dataclasses.replace(reserved, block_bytes=BB * 2)
    with pytest.raises(FailedPrecondition, match="pool changed"):
        _copy_in(ns, other_blocks, _blocks(10), lambda: None)  # type: ignore[arg-type]
    for slot in range(10):
        assert node.read(SlotId(slot)) == bytes(BB), slot


def test_an_inconsistent_packed_reply_is_refused() -> None:
    resp = pb.ReserveResponse(hashes=bytes(64), statuses=[0, 0], slots=[1])
    with pytest.raises(InvalidArgument, match="inconsistent"):
        reservation_from_proto(resp)


def _hit(mapping: HostMapping, slots: list[int], **kw: object) -> Hit:
    locations = tuple(
        BlockLocation(BlockHash(bytes([i]) * 32), SlotId(s), 1, s // SPA, s % SPA * BB)
        for i, s in enumerate(slots)
    )
    return Hit.of_locations(
        _Ns(mapping),  # type: ignore[arg-type]
        locations,
        hit_tokens=0,
        query_tokens=0,
        pinned=True,
        miss_reason=MissReason.ABSENT,
        epoch=7,
        mapping=mapping,
        **kw,  # type: ignore[arg-type]
    )


def test_copy_into_loads_a_hit_across_arenas(pool: tuple[HostPool, HostMapping]) -> None:
    node, mapping = pool
    slots = [2, 3, 4, 5, 6, 9, 0, 1]
    blocks = _blocks(len(slots))
    hit = _hit(mapping, slots)
    for block, slot, block_hash in zip(blocks, slots, hit.hashes, strict=True):
        node.write(SlotId(slot), block.tobytes())
        node.stamp(SlotId(slot), 1, stamp_ident(block_hash))  # READY at generation 1
    out = np.zeros_like(blocks)
    assert hit.copy_into(out).intact == len(slots)
    assert np.array_equal(out, blocks)
    flat = np.zeros(len(slots) * BB, dtype=np.uint8)  # any dtype and shape of the right size
    hit.copy_into(flat)
    assert flat.tobytes() == blocks.tobytes()
    assert [v.tobytes() for v in hit.numpy_views()] == [b.tobytes() for b in blocks]
    _hit(mapping, []).copy_into(np.zeros(0, dtype=np.uint8))  # an empty hit copies nothing


def test_copy_into_refuses_wrong_targets_and_released_hits(
    pool: tuple[HostPool, HostMapping],
) -> None:
    _, mapping = pool
    hit = _hit(mapping, [0, 1])
    with pytest.raises(InvalidArgument, match="bytes"):
        hit.copy_into(np.zeros(3 * BB, dtype=np.uint8))
    frozen = np.zeros(2 * BB, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(InvalidArgument, match="writable"):
        hit.copy_into(frozen)
    with pytest.raises(InvalidArgument, match="contiguous"):
        hit.copy_into(np.zeros((2 * BB, 2), dtype=np.uint8)[:, 0])
    released = _hit(mapping, [0, 1])
    released.release.begin()
    with pytest.raises(FailedPrecondition):
        released.copy_into(np.zeros(2 * BB, dtype=np.uint8))


def test_long_runs_are_copied_in_chunks_with_a_lease_check_each(
    pool: tuple[HostPool, HostMapping], monkeypatch: pytest.MonkeyPatch
) -> None:
    node, mapping = pool
    monkeypatch.setattr(transfer, "RUN_BYTES", 2 * BB)  # runs of 4 slots: chunks of 2
    blocks = _blocks(10)
    pairs = [(i, i) for i in range(10)]  # runs 0-3, 4-7, 8-9
    checks = 0

    def lease_alive() -> None:
        nonlocal checks
        checks += 1
        if checks == 4:
            raise LeaseExpired("lapsed")

    with pytest.raises(LeaseExpired):
        _copy_in(_Ns(mapping), _reserved(pairs), blocks, lease_alive)  # type: ignore[arg-type]
    for slot in range(10):
        expected = blocks[slot].tobytes() if slot < 6 else bytes(BB)  # 3 chunks copied
        assert node.read(SlotId(slot)) == expected, slot
