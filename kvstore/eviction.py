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

Pinned blocks need not leave the lists: a pin changes only the block's
``refcount``, so pinning a 512-block chain costs no list operation. The
lists hold every READY unpinned block, and may hold pinned ones too;
`first` and `first_in` unlink the pinned blocks they find at a head (each
at most once per time it was linked, so eviction stays O(1) amortised) and
never return one. A pinned block that was unlinked that way is linked
again by the touch that follows its last unpin (`kvstore.block_table`
touches every block it unpins). A touch moves a linked pinned block like
any other, so the order of the lists stays the order of use.
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
        """Every linked block (pinned ones too), next victim first (merged over scopes)."""
        return heapq.merge(*(iter(lst) for lst in self._lists.values()), key=_key)

    def evictable(self) -> list[Block]:
        """Every linked unpinned block, next victim first."""
        return [b for b in self if not b.refcount]

    def first(self) -> Block | None:
        """The node-wide next victim: the smallest key over the scopes' unpinned heads."""
        best: Block | None = None
        for scope in list(self._lists):
            head = self.first_in(scope)
            if head is not None and (best is None or head.lru_key < best.lru_key):
                best = head
        return best

    def first_in(self, scope: TenantId) -> Block | None:
        """The next victim of one scope (quota enforcement), or None.

        Pinned blocks found at the head are unlinked on the way (they are
        linked again when their last pin goes): O(1) amortised.
        """
        lst = self._lists.get(scope)
        if lst is None:
            return None
        head = lst.first()
        while head is not None and head.refcount:
            self.remove(head)
            head = lst.first()
        return head

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
        """Unlink a block from its scope's list in O(1) (an emptied list is dropped)."""
        lst = self._lists[block.scope]
        lst.remove(block)
        self._len -= 1
        if not len(lst):
            del self._lists[block.scope]

    def touch(self, touched: Iterable[Block], now: float, relink: Callable[[Block], None]) -> None:
        """Mark blocks and their ancestors most recently used, deepest first.

        READY blocks end up in the LRU: linked ones move, unlinked unpinned
        ones are linked (a pinned one unlinked by `first_in` stays out);
        orphans (parent removed) go to the eviction end instead. ``relink``
        is called on every block walked before its parent is followed, so a
        parent link to a removed record that was stored again since is
        repaired first (the block is then reachable, not an orphan). Cost:
        O(blocks + ancestors not already visited).
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
            if node.state is not BlockState.READY:
                continue
            if node.prev is not None:
                self.remove(node)
            elif node.refcount:
                continue
            if node.orphaned:
                self.appendleft(node)
            else:
                self.append(node)

    def touch_prefix(self, prefix: list[Block], now: float) -> None:
        """`touch` for a run of READY blocks that starts at depth 0, each the parent of the next.

        A lookup's hits, or the release of a chain from its first block:
        every ancestor of a block of the run is in the run, none is an
        orphan, so no walk, no dict and no sort is needed; moving the run to
        the most recent end deepest first (and bringing its ``last_used`` up
        to ``now``) is the whole job, in one pass (`LRUList.move_run_to_end`).
        """
        if not prefix:
            return
        lst = self._list(prefix[0].scope)
        before = len(lst)
        self._tick = lst.move_run_to_end(prefix, self._tick, now)
        self._len += len(lst) - before
        if not len(lst):
            del self._lists[prefix[0].scope]

    def _list(self, scope: TenantId) -> LRUList:
        lst = self._lists.get(scope)
        if lst is None:
            lst = self._lists[scope] = LRUList()
        return lst
