"""`ArenaPool`: a namespace pool that grows and shrinks by whole arenas.

Each arena is a one-arena pool of the node's kind (`HostPool`, `CudaPool`),
built by the caller (the node builds it in a worker thread: creating and
pre-faulting memory takes a while) and appended here; the last arena can be
taken off again to give its memory back. Slot *s* is in arena ``s //
slots_per_arena`` as in every pool, so the slot ids stay ``0 … capacity-1``
and the block table grows and shrinks at the same end.

The descriptor's ``version`` changes with every append and pop (the caller
passes a number unique in the epoch): runners compare it with the version a
Lookup or Reserve answer carries and re-attach when they differ.
"""

from __future__ import annotations

from dataclasses import replace

from kvstore.errors import InvalidArgument
from kvstore.pool.base import BlockPool, PoolDescriptor, PoolUnavailable, StampWriter
from kvstore.types import SlotId


class ArenaPool(BlockPool):
    """One-arena pools side by side, exported as one pool."""

    def __init__(self, first: BlockPool, version: int) -> None:
        """Start with one arena; its slot count is every arena's slot count."""
        d = first.descriptor
        if len(d.arenas) != 1:
            raise InvalidArgument(f"an ArenaPool is built of one-arena pools, got {len(d.arenas)}")
        self.slots_per_arena = d.capacity
        self._parts: list[BlockPool] = [first]
        # Each arena's stamp table, by arena: `stamp` runs twice per block written.
        self._stamp_tables: list[StampWriter | None] = [first.stamp_table]
        self._closed = False
        self.descriptor = self._describe(version)

    @property
    def arena_bytes(self) -> int:
        """Bytes of one arena."""
        return self.slots_per_arena * self.descriptor.block_bytes

    @property
    def arenas(self) -> int:
        """Arenas in the pool."""
        return len(self._parts)

    @property
    def huge_page_bytes(self) -> int:
        """Bytes of the arenas backed by huge pages."""
        return sum(part.huge_page_bytes for part in self._parts)

    def append(self, part: BlockPool, version: int) -> None:
        """Add an arena at the end (its slots follow the last slot)."""
        d = part.descriptor
        first = self._parts[0].descriptor
        if (d.kind, d.epoch, d.namespace, d.block_bytes, d.capacity, len(d.arenas)) != (
            first.kind,
            first.epoch,
            first.namespace,
            first.block_bytes,
            self.slots_per_arena,
            1,
        ):
            raise InvalidArgument("an appended arena must match the pool's kind and geometry")
        self._check_open()
        self._parts.append(part)
        self._stamp_tables.append(part.stamp_table)
        self.descriptor = self._describe(version)

    def pop(self, version: int) -> BlockPool:
        """Take the last arena off (never the only one); the caller closes it."""
        self._check_open()
        if len(self._parts) == 1:
            raise RuntimeError("bug: taking the only arena of a pool")
        part = self._parts.pop()
        self._stamp_tables.pop()
        self.descriptor = self._describe(version)
        return part

    def take_arenas(self) -> list[BlockPool]:
        """Close this pool without closing its arenas: the caller owns (and closes) them."""
        self._check_open()
        self._closed = True
        parts, self._parts = self._parts, []
        self._stamp_tables = []
        return parts

    def _describe(self, version: int) -> PoolDescriptor:
        first = self._parts[0].descriptor
        return replace(
            first,
            capacity=self.slots_per_arena * len(self._parts),
            slots_per_arena=self.slots_per_arena,
            arenas=tuple(
                replace(p.descriptor.arenas[0], index=i) for i, p in enumerate(self._parts)
            ),
            version=version,
        )

    def _part(self, slot: SlotId) -> tuple[BlockPool, SlotId]:
        self._check_open()
        arena, _ = self.descriptor.locate(slot)
        return self._parts[arena], SlotId(slot - arena * self.slots_per_arena)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolUnavailable(f"the pool of namespace {self.descriptor.namespace} is closed")

    def stamp(self, slot: SlotId, generation: int, ident: int) -> None:
        """Write ``slot``'s stamp into its arena's stamp file (nothing once closed).

        The node's `kvstore.stamps.StampSink` for this namespace's block table:
        arenas added later are covered as they come, and a stamp file goes
        with its arena when it is given back.
        """
        if self._closed:
            return  # dropped: the stamp files are gone with the arenas
        arena, local = divmod(slot, self.slots_per_arena)
        table = self._stamp_tables[arena]
        if table is not None:
            table.stamp(local, generation, ident)

    def view(self, slot: SlotId) -> memoryview:
        """Writable zero-copy view of one slot (host arenas only)."""
        part, local = self._part(slot)
        return part.view(local)

    def read(self, slot: SlotId) -> bytes:
        """A copy of one slot's bytes."""
        part, local = self._part(slot)
        return part.read(local)

    def read_into(self, slot: SlotId, dest: memoryview) -> None:
        """Copy one slot's bytes into ``dest`` (its arena's own copy: host or device)."""
        part, local = self._part(slot)
        part.read_into(local, dest)

    def write(self, slot: SlotId, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` (exactly ``block_bytes`` long) into ``slot``."""
        part, local = self._part(slot)
        part.write(local, data)

    @property
    def closed(self) -> bool:
        """True once `close` ran."""
        return self._closed

    def close(self) -> None:
        """Close every arena (unlinking host files); idempotent."""
        if self._closed:
            return
        self._closed = True
        parts, self._parts = self._parts, []
        self._stamp_tables = []
        errors = []
        for part in parts:
            try:
                part.close()
            except Exception as exc:  # close the others all the same
                errors.append(exc)
        if errors:
            raise errors[0]
