"""The slots of one namespace's pool: which are free, and their generations.

A slot is a block-sized place in the pool's memory, numbered 0 … capacity-1.
Every slot has a generation number, bumped each time the slot is given
back, so a (slot, generation) pair handed to a runner goes stale the moment
the slot could hold another block.
"""

from __future__ import annotations

from array import array

from kvstore.types import SlotId


class SlotAllocator:
    """Free slots as a stack, plus one generation counter per slot."""

    __slots__ = ("_free", "_generation", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # A stack: the most recently freed slot is reused first (its memory
        # is warm in the caches of whoever touched it last).
        self._free: list[SlotId] = [SlotId(s) for s in range(capacity - 1, -1, -1)]
        self._generation = array("Q", bytes(8 * capacity))

    @property
    def free(self) -> int:
        """Slots holding nothing."""
        return len(self._free)

    def generation(self, slot: SlotId) -> int:
        """Current generation of a slot."""
        return int(self._generation[slot])

    def take(self) -> SlotId | None:
        """A free slot, or None when every slot is in use."""
        return self._free.pop() if self._free else None

    def give_back(self, slot: SlotId) -> None:
        """Return a slot; its generation moves on so old handles go stale."""
        self._generation[slot] += 1
        self._free.append(slot)
