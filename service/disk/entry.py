"""A block's slot record in the disk index, and the intrusive LRU of them.

Why not a ``deque`` or an ``OrderedDict`` for the LRU (as `kvstore.lru` for
the memory tier): a read touches a block in the *middle* of its list, which
must be O(1) and allocate nothing; the links live in the records, between
two sentinels.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

Key = tuple[bytes, int, bytes]
"""(namespace, scope, block_hash): `DiskKey` as a tuple, cheaper to hash in loops."""


class EntryState(Enum):
    WRITING = "writing"
    READY = "ready"


@dataclass(slots=True, eq=False)
class Entry:
    """One block's slot. Linked into its size's LRU while READY (intrusive, like
    `kvstore.lru`: removal from the middle in O(1), nothing allocated)."""

    key: Key
    region: int
    slot: int
    length: int
    checksum: int
    seq: int
    state: EntryState
    touch: int = 0
    readers: int = 0
    dropped: bool = False
    """Forgotten (drop, discard) while I/O was in flight: its slot goes to limbo after."""
    prev: Entry | None = None
    next: Entry | None = None


class LRU:
    """Intrusive doubly linked list of READY entries, least recently used first."""

    __slots__ = ("_head", "_tail", "count")

    def __init__(self) -> None:
        self._head = Entry((b"", 0, b""), -1, -1, 0, 0, 0, EntryState.READY)
        self._tail = Entry((b"", 0, b""), -1, -1, 0, 0, 0, EntryState.READY)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.count = 0

    def __iter__(self) -> Iterator[Entry]:
        node = self._head.next
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    def append(self, e: Entry) -> None:
        assert e.prev is None and e.next is None, "entry already in the LRU"
        last = self._tail.prev
        assert last is not None
        e.prev, e.next = last, self._tail
        last.next = e
        self._tail.prev = e
        self.count += 1

    def remove(self, e: Entry) -> None:
        assert e.prev is not None and e.next is not None, "entry not in the LRU"
        e.prev.next = e.next
        e.next.prev = e.prev
        e.prev = e.next = None
        self.count -= 1
