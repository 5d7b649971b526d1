"""The slots of one namespace's pool: which are free, quarantined, and their generations.

A slot is a block-sized place in the pool's memory, numbered 0 … capacity-1.
Every slot has a stamp (`kvstore.stamps`): a generation taken from the
node's one `GenerationCounter` (so never repeated, even across namespaces
dropped and registered again) and an ident. The stamp moves on when the slot
is handed to a writer, when its block is committed, and when it is freed or
quarantined, so a (slot, generation) pair handed to a runner goes stale the
moment the slot could hold other bytes. Each new stamp is written through
the `StampSink` before the slot changes hands.

A generation only fences the node's own RPCs: a runner that maps the pool
writes the memory directly and never shows the node a generation. So a
slot taken from a writer whose lease *expired* (the writer may be a stalled
process that wakes up and finishes its copy) is not handed out again at
once: it is quarantined until a release time (``docs/leases.md``, "Late
writers"). And free slots are reused least recently freed first, so even a
slot freed cleanly rests as long as the free list allows before its next
owner writes it.

The pool grows and shrinks by whole arenas at its end (`add_slots`,
`retire_tail`): slot ids stay ``0 … capacity-1``. A slot added with a new
arena starts at generation 0, never stamped, like the new arena's zeroed
stamp memory: no handle ever carries generation 0, so a handle issued before
an id was retired is still stale when the id comes back.
"""

from __future__ import annotations

from array import array
from collections import deque

from kvstore.stamps import NEVER_STAMPED, GenerationCounter, MemoryStamps, StampSink
from kvstore.types import SlotId


class SlotAllocator:
    """Free slots in a FIFO, quarantined slots with their release times, generations.

    Counts: ``free + quarantined + in use == capacity``. A quarantined slot is
    never returned by `take` before its release time; once due it joins the
    *end* of the free list, after every ordinary free slot.
    """

    __slots__ = ("_counter", "_free", "_generation", "_ident", "_quarantine", "_sink", "capacity")

    def __init__(
        self,
        capacity: int,
        generations: GenerationCounter | None = None,
        stamps: StampSink | None = None,
    ) -> None:
        """``capacity`` free, never stamped slots.

        Args:
            capacity: slots of the pool.
            generations: the node's counter (shared by its namespaces); a private one if None.
            stamps: where the stamps go (the pool's stamp table); kept in memory if None.
        """
        self.capacity = capacity
        self._counter = generations if generations is not None else GenerationCounter()
        self._sink: StampSink = stamps if stamps is not None else MemoryStamps()
        # A FIFO, not a stack: the least recently freed slot is reused first,
        # so a freed slot stays unused as long as the pool's churn allows.
        self._free: deque[SlotId] = deque(SlotId(s) for s in range(capacity))
        # (release time, slot) in the order the slots were quarantined. Every
        # entry gets ``now + the same duration``, so release times ascend
        # whenever ``now`` does; if a caller's ``now`` ever went backwards, a
        # later entry merely waits behind an earlier one (never released early).
        self._quarantine: deque[tuple[float, SlotId]] = deque()
        self._generation = array("Q", bytes(8 * capacity))
        self._ident = array("Q", bytes(8 * capacity))

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

    def stamp_of(self, slot: SlotId) -> tuple[int, int]:
        """The (generation, ident) last written for ``slot``, as runners read it."""
        return int(self._generation[slot]), int(self._ident[slot])

    def restamp(self, slot: SlotId, ident: int = NEVER_STAMPED) -> int:
        """Give ``slot`` a new generation (and ``ident``: nonzero for READY only); returns it.

        Written to the sink at once: callers restamp *before* the slot changes
        hands (handed to a writer, freed), so a reader that saw the old stamp
        sees it move.
        """
        generation = self._counter.next()
        self._generation[slot] = generation
        self._ident[slot] = ident
        self._sink.stamp(slot, generation, ident)
        return generation

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
        """Return a slot; its stamp moves on first, so old handles and stamps go stale."""
        self.restamp(slot)
        self._free.append(slot)

    def quarantine(self, slot: SlotId, until: float) -> None:
        """Return a slot that its writer may still touch; reusable from ``until`` on.

        The stamp moves on at once, like `give_back`: the node's own RPCs
        refuse the old (slot, generation) from now, and readers see it move.
        """
        self.restamp(slot)
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
        seen = len(self._generation)  # ids below this were used (and retired) before
        missing = self.capacity - seen
        if missing > 0:
            self._generation.extend([NEVER_STAMPED] * missing)
            self._ident.extend([NEVER_STAMPED] * missing)
        # Ids seen before (retired) start over as never stamped, like the new
        # arena's zeroed stamp memory; no handle carries generation 0.
        for s in range(first, min(self.capacity, seen)):
            self._generation[s] = self._ident[s] = NEVER_STAMPED
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
