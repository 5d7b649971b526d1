"""Pointer-level tests of the intrusive LRU list."""

from __future__ import annotations

import itertools

from kvstore.block import Block
from kvstore.lru import LRUList
from kvstore.types import BlockHash, SlotId, TenantId


def make(i: int) -> Block:
    return Block(BlockHash(bytes([i]) * 32), TenantId("t"), SlotId(i), 0, None, 0)


def assert_links(lru: LRUList, expected: list[Block]) -> None:
    """Walk both directions and check every prev/next pointer."""
    assert list(lru) == expected
    assert len(lru) == len(expected)
    head = lru._head
    tail = lru._tail
    nodes = [head, *expected, tail]
    for left, right in itertools.pairwise(nodes):
        assert left.next is right
        assert right.prev is left
    assert head.prev is None and tail.next is None


def test_empty_list_links_sentinels() -> None:
    lru = LRUList()
    assert_links(lru, [])
    assert lru.first() is None


def test_append_and_appendleft() -> None:
    lru = LRUList()
    a, b, c = make(1), make(2), make(3)
    lru.append(a)
    lru.append(b)
    lru.appendleft(c)
    assert_links(lru, [c, a, b])
    assert lru.first() is c


def test_remove_from_middle_head_and_tail() -> None:
    lru = LRUList()
    blocks = [make(i) for i in range(5)]
    for b in blocks:
        lru.append(b)
    lru.remove(blocks[2])
    assert_links(lru, [blocks[0], blocks[1], blocks[3], blocks[4]])
    lru.remove(blocks[0])
    lru.remove(blocks[4])
    assert_links(lru, [blocks[1], blocks[3]])
    for removed in (blocks[0], blocks[2], blocks[4]):
        assert removed.prev is None and removed.next is None
        assert removed not in lru


def test_move_to_end_reorders_without_growing() -> None:
    lru = LRUList()
    a, b, c = make(1), make(2), make(3)
    for x in (a, b, c):
        lru.append(x)
    lru.move_to_end(a)
    assert_links(lru, [b, c, a])
    lru.move_to_end(a)
    assert_links(lru, [b, c, a])


def test_reinsert_after_remove() -> None:
    lru = LRUList()
    a = make(1)
    lru.append(a)
    lru.remove(a)
    lru.appendleft(a)
    assert_links(lru, [a])
