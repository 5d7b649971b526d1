"""The slots of one namespace's pool: which are free, and their generations.

A slot is a block-sized place in the pool's memory, numbered 0 … capacity-1.
Every slot has a generation number, bumped each time the slot is given
back, so a (slot, generation) pair handed to a runner goes stale the moment
the slot could hold another block.

The pool grows and shrinks by whole arenas at its end (`add_slots`,
`retire_tail`): slot ids stay ``0 … capacity-1``. A retired slot keeps its
generation, so when the same id comes back with a new arena, a handle issued
before the retirement is still stale.
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

    def add_slots(self, n: int) -> None:
        """Grow by ``n`` free slots numbered from the current capacity on."""
        if n <= 0:
            raise ValueError(f"bug: adding {n} slots")
        first = self.capacity
        self.capacity += n
        missing = self.capacity - len(self._generation)
        if missing > 0:  # ids seen before (retired) keep their generations
            self._generation.extend([0] * missing)
        # At the bottom of the stack: the slots freed before are used first, so
        # the last arena stays the emptiest one, the cheapest to give back.
        self._free[:0] = [SlotId(s) for s in range(self.capacity - 1, first - 1, -1)]

    def tail_is_free(self, n: int) -> bool:
        """Whether the last ``n`` slots are all free (O(free slots))."""
        first = self.capacity - n
        return sum(1 for s in self._free if s >= first) == n

    def retire_tail(self, n: int) -> None:
        """Shrink by the last ``n`` slots, which must all be free (O(free slots))."""
        if not 0 < n < self.capacity or not self.tail_is_free(n):
            raise RuntimeError(f"bug: retiring {n} of {self.capacity} slots that are not all free")
        first = self.capacity - n
        self._free = [s for s in self._free if s < first]
        self.capacity = first
