"""Intrusive doubly linked LRU list of evictable blocks.

Why not a ``deque`` or an ``OrderedDict``: a pin or a touch removes a block
from the *middle* of the list, which must be O(1) and allocate nothing. The
links live in the `Block` records themselves (`Block.prev` / `Block.next`),
between two dummy sentinels, so no operation has a special case for the ends
and no node object is allocated per operation.

The head side (``head.next``) is evicted first; the tail side is the most
recently used.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvstore.block import Block, BlockState
from kvstore.types import BlockHash, SlotId, TenantId


def _sentinel() -> Block:
    return Block(
        hash=BlockHash(b""),
        scope=TenantId(""),
        slot=SlotId(-1),
        generation=-1,
        parent=None,
        depth=-1,
        state=BlockState.FREE,
    )


class LRUList:
    """Evictable blocks, least recently used first."""

    __slots__ = ("_head", "_len", "_tail")

    def __init__(self) -> None:
        self._head = _sentinel()
        self._tail = _sentinel()
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: Block) -> bool:
        return block.prev is not None

    def __iter__(self) -> Iterator[Block]:
        """Blocks from the eviction end to the most recently used end."""
        node = self._head.next
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    def first(self) -> Block | None:
        """The next block to evict, or None when the list is empty."""
        node = self._head.next
        return None if node is self._tail else node

    def append(self, block: Block) -> None:
        """Insert at the most recently used end. The block must not be linked."""
        assert block.prev is None and block.next is None, "block already in the LRU"
        last = self._tail.prev
        assert last is not None
        block.prev = last
        block.next = self._tail
        last.next = block
        self._tail.prev = block
        self._len += 1

    def appendleft(self, block: Block) -> None:
        """Insert at the eviction end (orphans: reclaimed before anything else)."""
        assert block.prev is None and block.next is None, "block already in the LRU"
        first = self._head.next
        assert first is not None
        block.prev = self._head
        block.next = first
        first.prev = block
        self._head.next = block
        self._len += 1

    def remove(self, block: Block) -> None:
        """Unlink a block from anywhere in the list in O(1)."""
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, "block not in the LRU"
        prev.next = nxt
        nxt.prev = prev
        block.prev = None
        block.next = None
        self._len -= 1

    def move_to_end(self, block: Block) -> None:
        """Mark a linked block most recently used."""
        self.remove(block)
        self.append(block)

    def move_run_to_end(self, run: list[Block], tick: int, now: float) -> int:
        """Move a run of blocks to the most recently used end, last block first.

        A linked block moves (pinned or not); an unlinked one is appended
        unless it is pinned (a pinned block the eviction end dropped stays
        out until its last pin goes). Each block placed gets the next key
        from ``tick``; returns the last key used. Every block's ``last_used``
        is brought up to ``now``. The hot path of every
        lookup and release: one loop, no call per block.
        """
        tail = self._tail
        added = 0
        # Linked blocks and the sentinels always have both neighbours: the
        # ignores below stand for asserts this loop cannot afford per block.
        for node in reversed(run):
            if node.last_used < now:
                node.last_used = now
            prev = node.prev
            if prev is not None:
                nxt: Block = node.next  # type: ignore[assignment]
                prev.next = nxt
                nxt.prev = prev
            elif node.refcount:
                continue
            else:
                added += 1
            last: Block = tail.prev  # type: ignore[assignment]
            node.prev = last
            node.next = tail
            last.next = node
            tail.prev = node
            tick += 1
            node.lru_key = tick
        self._len += added
        return tick
