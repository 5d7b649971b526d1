"""Slot stamps: what a runner reads, with no RPC, to prove the slots it copied held its blocks.

Every slot of a pool carries a *stamp*, two 64-bit words:

- ``generation``: a number from the node's one `GenerationCounter`, never
  repeated within the node's pool epoch (namespaces dropped and registered
  again included); 0 means the slot was never stamped;
- ``ident``: for a READY block, the first 8 bytes of its hash read as a
  little-endian integer (`stamp_ident`); 0 while the slot is free or WRITING.

The core moves a slot's stamp on (a new generation) *before* anything may
change its bytes or its meaning: when it is handed to a writer (WRITING),
when its block is committed (READY: a READY block's generation is not the one
it was written under), and when it is freed, quarantined or evicted. A
reader that pinned a block (Lookup answers the READY generation) reads the
stamps of the slots it will copy, copies, makes sure the copy landed, and
reads them again: a block whose stamp is not ``(generation, ident)`` both
times was rewritten or reused meanwhile and must not be used.

The core writes stamps through `StampSink`; the node's is the pool's stamp
table in shared memory (`kvstore.pool.stamps`), pure-core tests use
`MemoryStamps`.
"""

from __future__ import annotations

from typing import Protocol

from kvstore.types import BlockHash, SlotId

NEVER_STAMPED = 0
"""Generation (and ident) of a slot nobody has stamped yet, and ident of a non-READY slot."""


class GenerationCounter:
    """The node's source of generations: 1, 2, 3, ... never repeated in one pool life.

    One instance is shared by every namespace of a `Store`, so a slot id of a
    namespace dropped and registered again never shows a generation it
    showed before (a per-namespace counter would restart, and a reader of the
    old pool could take a new block for the one it pinned).
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last = NEVER_STAMPED

    def next(self) -> int:
        """A generation never returned before."""
        self._last += 1
        return self._last

    @property
    def last(self) -> int:
        """The last generation returned (0 before the first)."""
        return self._last


class StampSink(Protocol):
    """Where the core writes slot stamps (the pool's stamp table on a node)."""

    def stamp(self, slot: SlotId, generation: int, ident: int) -> None:
        """Set ``slot``'s stamp; the generation word must be stored last (or with it at once)."""


class MemoryStamps:
    """A `StampSink` in a dict: the stamps a pure-core test can read back."""

    __slots__ = ("stamps",)

    def __init__(self) -> None:
        self.stamps: dict[SlotId, tuple[int, int]] = {}
        """Slot → (generation, ident) last written (absent: never stamped)."""

    def stamp(self, slot: SlotId, generation: int, ident: int) -> None:
        """Record ``slot``'s stamp."""
        self.stamps[slot] = (generation, ident)

    def get(self, slot: SlotId) -> tuple[int, int]:
        """The stamp of ``slot``, ``(0, 0)`` when never stamped."""
        return self.stamps.get(slot, (NEVER_STAMPED, NEVER_STAMPED))


def stamp_ident(block_hash: BlockHash | bytes) -> int:
    """The ident word of a READY block's stamp: its hash's first 8 bytes, little-endian."""
    return int.from_bytes(block_hash[:8], "little")
