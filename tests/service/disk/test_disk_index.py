"""The disk index alone: slots, regions per slot size, LRU, limbo (no I/O)."""

from __future__ import annotations

from service.disk.format import DATA_START, PAGE, RegionHeader, slot_bytes_for
from service.disk.index import DiskIndex, Key, Reservation

NS = b"a" * 16
REGION = 64 * PAGE  # 63 pages after the header: 7 slots of 8 + 1 pages (32 KiB blocks)
BLOCK = 32 << 10


def key(h: int, ns: bytes = NS) -> Key:
    return (ns, 0, h)


def write(index: DiskIndex, h: int, length: int = BLOCK, ns: bytes = NS) -> Reservation:
    res = index.reserve(key(h, ns), length, 1)
    assert res is not None
    assert index.committed(res.entry)
    return res


def test_first_reservation_assigns_a_region_and_writes_its_header_first() -> None:
    index = DiskIndex(regions=2, region_bytes=REGION)
    res = index.reserve(key(1), BLOCK, 7)
    assert res is not None
    assert res.region_header == (DATA_START, RegionHeader(slot_bytes_for(BLOCK), 1, 0))
    assert res.offset == DATA_START + PAGE and not res.invalidate
    assert index.run_length(NS, 0, [1]) == 0, "a block being written is not visible"
    assert index.committed(res.entry)
    assert index.run_length(NS, 0, [1, 2]) == 1
    second = index.reserve(key(2), BLOCK, 7)
    assert second is not None and second.region_header is None
    assert second.offset == res.offset + slot_bytes_for(BLOCK)


def test_lru_eviction_order_within_a_size_and_reads_touch() -> None:
    index = DiskIndex(regions=1, region_bytes=REGION)
    for h in range(7):
        write(index, h)
    e = index.begin_read(key(0))
    assert e is not None
    index.end_read(e, touch=True, discard=False)  # 0 becomes the most recently used
    res = index.reserve(key(100), BLOCK, 1)
    assert res is not None and res.invalidate, "a reused slot's old header is zeroed first"
    assert index.take_removed() == [key(1)]
    index.committed(res.entry)
    res = index.reserve(key(101), BLOCK, 1)
    assert res is not None and index.take_removed() == [key(2)]
    assert key(0) in index and index.evictions == 2


def test_a_block_being_read_is_not_evicted() -> None:
    index = DiskIndex(regions=1, region_bytes=REGION)
    for h in range(7):
        write(index, h)
    e = index.begin_read(key(0))
    assert e is not None
    index.reserve(key(100), BLOCK, 1)
    assert index.take_removed() == [key(1)]


def test_other_sizes_take_the_least_recently_used_region() -> None:
    index = DiskIndex(regions=2, region_bytes=REGION)
    for h in range(7):
        write(index, h)  # region 0: 32 KiB blocks
    for h in range(10, 13):
        write(index, h, length=16 << 10)  # region 1: 16 KiB blocks
    big = [index.reserve(key(h), 60 << 10, 1) for h in (20,)]
    assert big[0] is not None
    # Region 0 was touched longest ago: all its blocks go, its header gets a new epoch.
    assert sorted(index.take_removed()) == [key(h) for h in range(7)]
    assert big[0].region_header is not None and big[0].region_header[1].epoch == 3
    assert index.run_length(NS, 0, [10, 11, 12]) == 3


def test_nothing_to_take_is_a_refusal() -> None:
    index = DiskIndex(regions=1, region_bytes=REGION)
    held = [index.reserve(key(h), BLOCK, 1) for h in range(7)]  # all WRITING
    assert all(held)
    assert index.reserve(key(99), BLOCK, 1) is None
    assert index.reserve(key(98), REGION, 1) is None, "larger than a region"


def test_drop_waits_for_invalidation_before_the_slot_is_free() -> None:
    index = DiskIndex(regions=1, region_bytes=REGION)
    for h in range(3):
        write(index, h)
    write(index, 50, ns=b"b" * 16)
    assert index.drop_namespace(NS) == 3
    assert index.run_length(NS, 0, [0]) == 0 and index.ready_blocks == 1
    assert index.per_namespace() == {b"b" * 16: 1}
    jobs = index.take_invalidations()
    assert len(jobs) == 3
    res = index.reserve(key(7), BLOCK, 1)
    assert res is not None and res.offset not in {o for o, _, _ in jobs}, (
        "limbo slots are not reused"
    )
    for _, region, slot in jobs:
        index.invalidated(region, slot)
    assert index.region(0).limbo == set()


def test_a_region_empties_and_is_handed_back() -> None:
    index = DiskIndex(regions=1, region_bytes=REGION)
    write(index, 1)
    index.drop_namespace(NS)
    for _, region, slot in index.take_invalidations():
        index.invalidated(region, slot)
    assert index.region(0).slot_bytes == 0
    res = index.reserve(key(2), 16 << 10, 1)  # another size gets it, with a new epoch
    assert res is not None and res.region_header is not None and res.region_header[1].epoch == 2


def test_dropped_while_writing_goes_to_limbo_when_the_write_ends() -> None:
    index = DiskIndex(regions=1, region_bytes=REGION)
    res = index.reserve(key(1), BLOCK, 1)
    assert res is not None
    index.drop_namespace(NS)
    assert index.take_invalidations() == []
    assert not index.committed(res.entry)
    assert len(index.take_invalidations()) == 1
    assert key(1) not in index


def test_failed_write_and_failed_read_leave_no_entry() -> None:
    index = DiskIndex(regions=1, region_bytes=REGION)
    res = index.reserve(key(1), BLOCK, 1)
    assert res is not None
    index.write_failed(res.entry)
    assert key(1) not in index and len(index.take_invalidations()) == 1
    write(index, 2)
    e = index.begin_read(key(2))
    assert e is not None
    index.end_read(e, touch=False, discard=True)
    assert key(2) not in index and index.take_removed() == [key(2)]
    assert len(index.take_invalidations()) == 1


def test_adopt_keeps_the_newest_write_of_a_block() -> None:
    index = DiskIndex(regions=1, region_bytes=REGION)
    size = slot_bytes_for(BLOCK)
    found = [(9, 3, key(1), BLOCK, 11), (4, 0, key(1), BLOCK, 10), (5, 1, key(2), BLOCK, 1)]
    index.adopt_region(0, RegionHeader(size, 5, 0), found)
    index.adopted()
    e = index.ready(key(1))
    assert e is not None and e.slot == 3 and e.checksum == 11
    assert [(r, s) for _, r, s in index.take_invalidations()] == [(0, 0)]
    assert index.next_seq == 10 and index.next_epoch == 6
    assert index.take_removed() == []
    # LRU follows the write sequence: key(2) (seq 5) goes before key(1) (seq 9).
    for h in range(100, 104):
        index.reserve(key(h), BLOCK, 1)  # the free slots: 2, 4, 5, 6
    assert index.region(0).limbo == {0}
    index.reserve(key(200), BLOCK, 1)
    assert index.take_removed() == [key(2)]


def test_snapshot_and_restore_keep_blocks_lru_and_limbo() -> None:
    index = DiskIndex(regions=2, region_bytes=REGION)
    for h in range(5):
        write(index, h)
    write(index, 9, length=16 << 10)
    e = index.begin_read(key(0))
    assert e is not None
    index.end_read(e, touch=True, discard=False)
    index.drop_namespace(b"x" * 16)
    e = index.begin_read(key(3))
    assert e is not None
    index.end_read(e, touch=False, discard=True)  # slot 3 in limbo
    snap = index.snapshot()
    assert [s[3] for s in snap.entries] == [key(1), key(2), key(4), key(9), key(0)]
    assert snap.limbo == [(0, 3)]

    again = DiskIndex(regions=2, region_bytes=REGION)
    again.restore(snap)
    assert again.run_length(NS, 0, [0, 1, 2]) == 3 and key(3) not in again
    assert [(r, s) for _, r, s in again.take_invalidations()] == [(0, 3)]
    assert again.ready_blocks == 5 and again.next_seq == index.next_seq
    for h in range(100, 102):
        again.reserve(key(h), BLOCK, 1)  # the free slots 5, 6
    again.reserve(key(200), BLOCK, 1)
    assert again.take_removed() == [key(1)], "the LRU order came back"
