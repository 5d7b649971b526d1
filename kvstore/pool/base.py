"""Block pools: the memory that holds a namespace's block bytes.

A pool is ``capacity`` block-sized slots carved out of a few large *arenas*.
The server owns the memory (`BlockPool`); a runner maps each arena once
(`PoolMapping`) and addresses a block by ``(arena, offset)``, so it pays one
``mmap`` (or one CUDA IPC open) per arena, never one per block.

Invariants every pool keeps (and `PoolDescriptor` checks):

* slots never straddle arenas: ``slots_per_arena = max(1, arena_bytes //
  block_bytes)``; arena *a* holds slots ``[a * slots_per_arena, (a + 1) *
  slots_per_arena)``, and only the last arena may hold fewer;
* slot *s* lives in arena ``s // slots_per_arena`` at byte offset ``(s %
  slots_per_arena) * block_bytes``;
* ``len(arenas) == ceil(capacity / slots_per_arena)``.

Only `kvstore.pool` touches shared or device memory; the rest of the package
sees `memoryview` objects, numpy arrays and torch tensors handed out here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from kvstore.checksum import block_checksum
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.pool.views import numpy_block_view, torch_block_view
from kvstore.types import NamespaceId, SlotId

if TYPE_CHECKING:
    import torch

    from kvstore.layout import KVLayout

POOL_KINDS = ("host", "cuda")
"""Kinds of pool a descriptor may name."""


class PoolUnavailable(FailedPrecondition):
    """A pool cannot be attached: its memory is gone, resized or not supported here.

    A missing or resized arena file means the server restarted (or dropped the
    namespace) since the descriptor was issued: ask for a fresh one with
    ``AttachPool``.
    """


@dataclass(frozen=True, slots=True)
class ArenaSpec:
    """One exported arena of a pool."""

    index: int
    """Position in `PoolDescriptor.arenas`; arena *i* holds slots from ``i * slots_per_arena``."""
    size_bytes: int
    """Bytes of the arena (``slots in it * block_bytes``)."""
    path: str = ""
    """Host pool: path of the shared-memory file to map."""
    cuda_ipc_handle: bytes = b""
    """CUDA pool: the ``cudaIpcMemHandle_t`` of the arena (64 bytes)."""
    stamp_path: str = ""
    """Path of the arena's stamp file in host shared memory (`kvstore.pool.stamps`);
    empty from a node without stamps."""


@dataclass(frozen=True, slots=True)
class PoolDescriptor:
    """Everything a runner needs to map a namespace's pool (what ``AttachPool`` sends)."""

    kind: str
    """``"host"`` or ``"cuda"``."""
    epoch: int
    """The node's pool epoch (random 63-bit per server start); a change voids mappings."""
    namespace: NamespaceId
    """Namespace the pool backs."""
    block_bytes: int
    """Bytes of one block (one slot)."""
    capacity: int
    """Number of slots."""
    slots_per_arena: int
    """Slots in every arena but possibly the last."""
    arenas: tuple[ArenaSpec, ...]
    """The arenas, in index order."""
    device: str = "cpu"
    """``"cpu"``, or the GPU's UUID for CUDA pools."""
    version: int = 0
    """Which arena set this is: the node raises it whenever it adds an arena to the
    pool or gives one back (it only grows within an epoch). A Lookup or Reserve answer
    with another version means: attach again, then `PoolMapping.refresh`."""

    @property
    def checksummed(self) -> bool:
        """Every block in this pool carries its writer's checksum (`kvstore.checksum`):
        true of host pools, whose writers hash what they copy; a CUDA pool's writers
        send none (no device kernel for it yet, docs/cuda.md)."""
        return self.kind == "host"

    def __post_init__(self) -> None:
        if self.kind not in POOL_KINDS:
            raise InvalidArgument(f"pool kind {self.kind!r} is not one of {POOL_KINDS}")
        for name in ("block_bytes", "capacity", "slots_per_arena"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"pool {name} must be a positive integer, got {value!r}")
        expected = -(-self.capacity // self.slots_per_arena)
        if len(self.arenas) != expected:
            raise InvalidArgument(
                f"a pool of {self.capacity} slots at {self.slots_per_arena} per arena has "
                f"{expected} arenas, the descriptor lists {len(self.arenas)}"
            )
        for i, arena in enumerate(self.arenas):
            if arena.index != i:
                raise InvalidArgument(f"arena at position {i} has index {arena.index}")
            needed = self.slots_in_arena(i) * self.block_bytes
            if arena.size_bytes < needed:
                raise InvalidArgument(
                    f"arena {i} is {arena.size_bytes} bytes, its slots need {needed}"
                )

    def slots_in_arena(self, index: int) -> int:
        """Slots held by arena ``index`` (only the last one may hold fewer)."""
        first = index * self.slots_per_arena
        return min(self.slots_per_arena, self.capacity - first)

    def locate(self, slot: int) -> tuple[int, int]:
        """Arena index and byte offset in that arena of ``slot``.

        Raises:
            InvalidArgument: ``slot`` is not in ``[0, capacity)``.
        """
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.capacity:
            raise InvalidArgument(f"slot {slot!r} is out of range [0, {self.capacity})")
        arena, index = divmod(slot, self.slots_per_arena)
        return arena, index * self.block_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of all arenas together."""
        return sum(a.size_bytes for a in self.arenas)


def plan_arenas(block_bytes: int, capacity: int, arena_bytes: int) -> tuple[int, list[int]]:
    """A new pool's ``slots_per_arena`` and the slots of each of its arenas.

    Raises:
        InvalidArgument: a non-positive size.
    """
    if block_bytes <= 0 or capacity <= 0 or arena_bytes <= 0:
        raise InvalidArgument(
            f"block_bytes, capacity and arena_bytes must be positive, got "
            f"{block_bytes}, {capacity}, {arena_bytes}"
        )
    per_arena = max(1, arena_bytes // block_bytes)
    return per_arena, [min(per_arena, capacity - first) for first in range(0, capacity, per_arena)]


class StampWriter(Protocol):
    """The node's stamp table of a pool (`kvstore.pool.stamps.StampTable`)."""

    def stamp(self, slot: int, generation: int, ident: int) -> None:
        """Write one slot's stamp, the generation word last."""

    def close(self) -> None:
        """Unlink and unmap the stamp files."""


class StampReading(Protocol):
    """A runner's view of a pool's stamps (`kvstore.pool.stamps.StampReader`)."""

    def read(self, slots: npt.ArrayLike) -> npt.NDArray[np.uint64]:
        """Stamps of ``slots``, shape ``(n, 2)``: generation, ident."""

    def moved(
        self, slots: npt.ArrayLike, generations: npt.ArrayLike, idents: npt.ArrayLike
    ) -> npt.NDArray[np.intp]:
        """Indices of ``slots`` whose stamp is not the expected one."""


class BlockPool(ABC):
    """Server side of a pool: owns the memory and exports it by `descriptor`.

    `view` hands out zero-copy views; `close` unmaps and frees the memory.
    A view still referenced when the pool closes keeps its arena mapped (the
    memory stays valid, it is merely no longer shared), so closing never
    leaves a dangling pointer.
    """

    descriptor: PoolDescriptor
    """What a runner needs to map this pool."""
    stamp_table: StampWriter | None = None
    """The slots' stamps in host shared memory (None: this pool has none)."""

    def locate(self, slot: SlotId) -> tuple[int, int]:
        """Arena index and byte offset of ``slot`` (see `PoolDescriptor.locate`)."""
        return self.descriptor.locate(slot)

    def stamp(self, slot: SlotId, generation: int, ident: int) -> None:
        """Write ``slot``'s stamp for runners (a `kvstore.stamps.StampSink`).

        Nothing for a pool without a stamp table, or a closed one (its
        stamps went with its files).
        """
        if self.stamp_table is not None:
            self.stamp_table.stamp(slot, generation, ident)

    @abstractmethod
    def view(self, slot: SlotId) -> memoryview:
        """Writable zero-copy view of one slot, ``block_bytes`` long."""

    @property
    def huge_page_bytes(self) -> int:
        """Bytes the kernel backs with huge pages (host pools; measured when pre-faulted)."""
        return 0

    def read(self, slot: SlotId) -> bytes:
        """A copy of one slot's bytes."""
        return bytes(self.view(slot))

    def read_into(self, slot: SlotId, dest: memoryview) -> None:
        """Copy one slot's bytes into ``dest`` (writable, ``block_bytes`` long); from any
        thread (the copy lets go of the GIL).

        Raises:
            InvalidArgument: ``dest`` is not ``block_bytes`` long, or the slot is out of range.
        """
        out = block_destination(dest, self.descriptor.block_bytes, slot)
        np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(self.view(slot), np.uint8))

    def checksum(self, slot: SlotId) -> int:
        """The checksum of one slot's bytes as they lie now (`kvstore.checksum`)."""
        return block_checksum(self.view(slot))

    def write(self, slot: SlotId, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` (exactly ``block_bytes`` long) into ``slot``.

        Raises:
            InvalidArgument: wrong length or slot out of range.
        """
        size = memoryview(data).nbytes
        if size != self.descriptor.block_bytes:
            raise InvalidArgument(
                f"a block is {self.descriptor.block_bytes} bytes, got {size} for slot {slot}"
            )
        target = self.view(slot)
        target[:] = memoryview(data).cast("B")

    @abstractmethod
    def close(self) -> None:
        """Unmap and free the memory; idempotent."""

    def __enter__(self) -> BlockPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def block_destination(dest: memoryview, block_bytes: int, slot: SlotId) -> memoryview:
    """``dest`` as bytes, checked to hold one block (every pool's `BlockPool.read_into`).

    Raises:
        InvalidArgument: ``dest`` is not ``block_bytes`` long.
    """
    out = memoryview(dest).cast("B")
    if out.nbytes != block_bytes:
        raise InvalidArgument(f"a block is {block_bytes} bytes, not {out.nbytes} (slot {slot})")
    return out


class PoolMapping(ABC):
    """Runner side of a pool: the arenas mapped into this process."""

    descriptor: PoolDescriptor
    """The descriptor this mapping was attached with (its epoch included)."""

    @abstractmethod
    def buffer(self, slot: SlotId) -> memoryview:
        """Writable zero-copy view of one slot, ``block_bytes`` long."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once `close` ran; a closed mapping hands out nothing."""

    def numpy_view(self, slot: SlotId, layout: KVLayout) -> npt.NDArray[np.generic]:
        """Zero-copy numpy array of one slot, shaped ``layout.block_shape``.

        ``bfloat16`` has no numpy dtype and comes back as ``uint16`` (the same
        bits); the float8 dtypes come back as ``uint8``.
        """
        self._check_layout(layout)
        return numpy_block_view(self.buffer(slot), layout)

    def torch_view(self, slot: SlotId, layout: KVLayout) -> torch.Tensor:
        """Zero-copy tensor of one slot with the layout's exact dtype and shape.

        On the CPU for host pools, on the pool's GPU for CUDA pools.
        """
        self._check_layout(layout)
        return torch_block_view(self.buffer(slot), layout)

    @property
    def has_stamps(self) -> bool:
        """Whether this mapping reads the pool's slot stamps (nodes before them send none)."""
        return self._stamp_reader() is not None

    def read_stamps(self, slots: npt.ArrayLike) -> npt.NDArray[np.uint64]:
        """The current stamps of ``slots``: shape ``(n, 2)`` uint64, generation then ident.

        Read from host shared memory with no RPC and no GPU sync, for CUDA
        pools too. Read them after the copy out of the slots has landed
        (GPU: synchronise the copy's stream first) and compare with what the
        lookup answered (`stamps_moved`).

        Raises:
            PoolUnavailable: the node sent no stamp table, or the mapping is closed.
            InvalidArgument: a slot outside the mapped pool.
        """
        return self._stamps().read(slots)

    def stamps_moved(
        self, slots: npt.ArrayLike, generations: npt.ArrayLike, idents: npt.ArrayLike
    ) -> npt.NDArray[np.intp]:
        """Indices ``i`` whose slot ``slots[i]`` no longer shows ``(generations[i], idents[i])``.

        ``generations`` are the Lookup's (READY) generations, ``idents``
        their hashes' idents (`kvstore.pool.stamps.idents_of`). A block at an
        index returned was (or may have been: a torn read) rewritten or
        reused: its copied bytes must not be used. Raises as `read_stamps`.
        """
        return self._stamps().moved(slots, generations, idents)

    def _stamp_reader(self) -> StampReading | None:
        """The stamp mappings of this pool (None: none)."""
        return None

    def _stamps(self) -> StampReading:
        if self.closed:
            raise PoolUnavailable(f"the mapping of namespace {self.descriptor.namespace} is closed")
        reader = self._stamp_reader()
        if reader is None:
            raise PoolUnavailable(
                f"the node sent no slot stamps for namespace {self.descriptor.namespace} "
                "(it predates them): loads cannot be verified"
            )
        return reader

    def synchronize(self) -> None:
        """Wait until writes into the slots issued by this thread are complete.

        Host pools: nothing to wait for (copies into shared memory are done
        when they return). CUDA pools wait for the copy streams; the client
        calls this before ``Commit``.
        """
        return None  # host memory: a copy is complete when it returns

    def read_fence(self, streams: Sequence[Any] | None = None) -> Callable[[], None] | None:
        """A wait for the reads of slots queued so far, to run before their pins are dropped.

        Host pools: None, nothing to wait for (the CPU has read a slot when
        the code that read it returns). CUDA pools record an event on each
        stream now (``streams``, default: the caller's current streams) and
        return a callable that waits for them: a slot must not be released,
        and so rewritten by another runner, while GPU reads of it are queued.
        """
        return None

    def _check_layout(self, layout: KVLayout) -> None:
        if layout.block_bytes != self.descriptor.block_bytes:
            raise InvalidArgument(
                f"layout blocks are {layout.block_bytes} bytes, this pool's are "
                f"{self.descriptor.block_bytes}"
            )

    def refresh(self, descriptor: PoolDescriptor) -> bool:
        """Follow a newer arena set of the same pool in place; False when this kind cannot.

        Arenas whose export is unchanged stay mapped (views of them stay
        valid); new ones are mapped, replaced ones are remapped, arenas given
        back are unmapped. The caller attaches anew when this returns False.
        """
        return False

    @abstractmethod
    def close(self) -> None:
        """Unmap the arenas (views still referenced keep theirs alive); idempotent."""

    def __enter__(self) -> PoolMapping:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
