"""The slots of one namespace's pool: which are free, quarantined, and their generations.

A slot is a block-sized place in the pool's memory, numbered 0 … capacity-1.
Every slot has a generation number, bumped each time the slot is given
back, so a (slot, generation) pair handed to a runner goes stale the moment
the slot could hold another block.

A generation only fences the node's own RPCs: a runner that maps the pool
writes the memory directly and never shows the node a generation. So a
slot taken from a writer whose lease *expired* (the writer may be a stalled
process that wakes up and finishes its copy) is not handed out again at
once: it is quarantined until a release time (``docs/leases.md``, "Late
writers"). And free slots are reused least recently freed first, so even a
slot freed cleanly rests as long as the free list allows before its next
owner writes it.

The pool grows and shrinks by whole arenas at its end (`add_slots`,
`retire_tail`): slot ids stay ``0 … capacity-1``. A retired slot keeps its
generation, so when the same id comes back with a new arena, a handle issued
before the retirement is still stale.
"""

from __future__ import annotations

from array import array
from collections import deque

from kvstore.types import SlotId


class SlotAllocator:
    """Free slots in a FIFO, quarantined slots with their release times, generations.

    Counts: ``free + quarantined + in use == capacity``. A quarantined slot is
    never returned by `take` before its release time; once due it joins the
    *end* of the free list, after every ordinary free slot.
    """

    __slots__ = ("_free", "_generation", "_quarantine", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # A FIFO, not a stack: the least recently freed slot is reused first,
        # so a freed slot stays unused as long as the pool's churn allows.
        self._free: deque[SlotId] = deque(SlotId(s) for s in range(capacity))
        # (release time, slot) in the order the slots were quarantined. Every
        # entry gets ``now + the same duration``, so release times ascend
        # whenever ``now`` does; if a caller's ``now`` ever went backwards, a
        # later entry merely waits behind an earlier one (never released early).
        self._quarantine: deque[tuple[float, SlotId]] = deque()
        self._generation = array("Q", bytes(8 * capacity))

    @property
    def free(self) -> int:
        """Slots holding nothing that may be handed out now."""
        return len(self._free)

    @property
    def quarantined(self) -> int:
        """Slots holding nothing that wait for their release time (some may be due)."""
        return len(self._quarantine)

    def generation(self, slot: SlotId) -> int:
        """Current generation of a slot."""
        return int(self._generation[slot])

    def release_due(self, now: float) -> int:
        """Move quarantined slots whose release time is at or before ``now`` to the free list.

        Returns how many moved; they queue behind the slots already free.
        """
        moved = 0
        quarantine = self._quarantine
        while quarantine and quarantine[0][0] <= now:
            self._free.append(quarantine.popleft()[1])
            moved += 1
        return moved

    def available(self, now: float) -> int:
        """Slots `take` may hand out at ``now`` (due quarantined slots included)."""
        self.release_due(now)
        return len(self._free)

    def take(self, now: float) -> SlotId | None:
        """The least recently freed slot, or None when none may be handed out at ``now``."""
        self.release_due(now)
        return self._free.popleft() if self._free else None

    def take_many(self, n: int) -> list[SlotId]:
        """Up to ``n`` free slots, least recently freed first (call `available` first).

        Quarantined slots that have come due are not moved here: `available`
        (or `release_due`) does that.
        """
        free = self._free
        return [free.popleft() for _ in range(min(n, len(free)))]

    def untake(self, slots: list[SlotId]) -> None:
        """Put slots `take_many` gave, unused, back at the front of the free list.

        Nobody was told of them, so their generations stay.
        """
        self._free.extendleft(reversed(slots))

    def give_back(self, slot: SlotId) -> None:
        """Return a slot; its generation moves on so old handles go stale."""
        self._generation[slot] += 1
        self._free.append(slot)

    def quarantine(self, slot: SlotId, until: float) -> None:
        """Return a slot that its writer may still touch; reusable from ``until`` on.

        The generation moves on at once, like `give_back`: the node's own
        RPCs refuse the old (slot, generation) from now.
        """
        self._generation[slot] += 1
        self._quarantine.append((until, slot))

    def quarantine_snapshot(self) -> list[tuple[float, SlotId]]:
        """(release time, slot) of every quarantined slot, oldest first (for tests and tools)."""
        return list(self._quarantine)

    def add_slots(self, n: int) -> None:
        """Grow by ``n`` free slots numbered from the current capacity on."""
        if n <= 0:
            raise ValueError(f"bug: adding {n} slots")
        first = self.capacity
        self.capacity += n
        missing = self.capacity - len(self._generation)
        if missing > 0:  # ids seen before (retired) keep their generations
            self._generation.extend([0] * missing)
        # At the end of the FIFO: the slots freed before are used first, so the
        # last arena stays the emptiest one, the cheapest to give back.
        self._free.extend(SlotId(s) for s in range(first, self.capacity))

    def tail_is_free(self, n: int) -> bool:
        """Whether the last ``n`` slots are all free, none quarantined (O(free slots))."""
        first = self.capacity - n
        return sum(1 for s in self._free if s >= first) == n

    def tail_quarantined(self, n: int) -> bool:
        """Whether one of the last ``n`` slots is quarantined (O(quarantined slots))."""
        first = self.capacity - n
        return any(s >= first for _, s in self._quarantine)

    def retire_tail(self, n: int) -> None:
        """Shrink by the last ``n`` slots, which must all be free (O(free slots))."""
        if not 0 < n < self.capacity or not self.tail_is_free(n):
            raise RuntimeError(f"bug: retiring {n} of {self.capacity} slots that are not all free")
        first = self.capacity - n
        self._free = deque(s for s in self._free if s < first)
        self.capacity = first
