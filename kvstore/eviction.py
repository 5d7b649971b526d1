"""Evictable blocks of one namespace: one LRU list per tenant scope.

Why per scope: a tenant's quota (``max_blocks``) must be enforced by
evicting *its own* least recently used block, found in O(1); and each
scope's blocks form their own prefix trees, so the leaves-first order of
`kvstore.block_table` holds inside every list on its own.

The node-wide victim (a free slot is needed and no quota applies) is the
best head over all scopes: every block carries ``lru_key``, drawn from one
counter per namespace when it enters a list (``+tick`` at the recently used
end, ``-tick`` at the eviction end for orphans). Each list is therefore
sorted by key, and merging the lists by key gives exactly the order one
global LRU list would have had: orphans first (the newest orphan first),
then least recently used. Finding it costs O(number of scopes with
evictable blocks) per eviction: a few hundred tenants is cheap next to the
gRPC call around it; thousands of tenants per namespace would want a heap
of heads instead.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

from kvstore.block import Block, BlockState
from kvstore.lru import LRUList
from kvstore.types import TenantId


def _key(block: Block) -> int:
    return block.lru_key


def _depth(block: Block) -> int:
    return block.depth


class ScopedLRU:
    """Evictable blocks, one intrusive `LRUList` per scope, one shared order."""

    __slots__ = ("_len", "_lists", "_tick")

    def __init__(self) -> None:
        self._lists: dict[TenantId, LRUList] = {}
        self._tick = 0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: Block) -> bool:
        return block.prev is not None

    def __iter__(self) -> Iterator[Block]:
        """Every evictable block, next victim first (merged over scopes)."""
        return heapq.merge(*(iter(lst) for lst in self._lists.values()), key=_key)

    def in_scope(self, scope: TenantId) -> int:
        """Evictable blocks of one scope."""
        lst = self._lists.get(scope)
        return len(lst) if lst is not None else 0

    def first(self) -> Block | None:
        """The node-wide next victim: the smallest key over the scopes' heads."""
        best: Block | None = None
        for lst in self._lists.values():
            head = lst.first()
            if head is not None and (best is None or head.lru_key < best.lru_key):
                best = head
        return best

    def first_in(self, scope: TenantId) -> Block | None:
        """The next victim of one scope (quota enforcement), or None."""
        lst = self._lists.get(scope)
        return lst.first() if lst is not None else None

    def append(self, block: Block) -> None:
        """Insert at the most recently used end of its scope's list."""
        self._tick += 1
        block.lru_key = self._tick
        self._list(block.scope).append(block)
        self._len += 1

    def appendleft(self, block: Block) -> None:
        """Insert at the eviction end (orphans: reclaimed before anything else)."""
        self._tick += 1
        block.lru_key = -self._tick
        self._list(block.scope).appendleft(block)
        self._len += 1

    def remove(self, block: Block) -> None:
        """Unlink a block from its scope's list in O(1)."""
        lst = self._lists[block.scope]
        lst.remove(block)
        self._len -= 1
        if not len(lst):
            del self._lists[block.scope]

    def touch(self, touched: Iterable[Block], now: float, relink: Callable[[Block], None]) -> None:
        """Mark blocks and their ancestors most recently used, deepest first.

        Blocks that are READY and unpinned end up in the LRU; orphans (parent
        removed) go to its eviction end instead. ``relink`` is called on every
        block walked before its parent is followed, so a parent link to a
        removed record that was stored again since is repaired first (the
        block is then reachable, not an orphan). Cost: O(blocks + ancestors
        not already visited).
        """
        visited: dict[Block, None] = {}
        for block in touched:
            node: Block | None = block
            while node is not None and node not in visited and node.state is not BlockState.FREE:
                visited[node] = None
                relink(node)
                node = node.parent
        for node in sorted(visited, key=_depth, reverse=True):
            if node.last_used < now:
                node.last_used = now
            if node.state is not BlockState.READY or node.refcount:
                continue
            if node in self:
                self.remove(node)
            if node.orphaned:
                self.appendleft(node)
            else:
                self.append(node)

    def touch_prefix(self, prefix: list[Block]) -> None:
        """`touch` for a run of blocks that starts at depth 0 (a lookup's hits).

        Every ancestor of a block of the run is in the run, so no walk is
        needed: moving the run to the most recent end deepest first is the
        whole job. This is the hot path of every unpinned lookup.
        """
        for node in reversed(prefix):
            if node.refcount:
                continue
            self.remove(node)
            self.append(node)

    def _list(self, scope: TenantId) -> LRUList:
        lst = self._lists.get(scope)
        if lst is None:
            lst = self._lists[scope] = LRUList()
        return lst
