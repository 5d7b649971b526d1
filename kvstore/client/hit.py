"""A lookup's answer: `Hit`, where its blocks are, and what its checks found.

A `Hit` is the answer of a lookup: where the hit blocks are (`BlockLocation`),
and zero-copy views of them through the mapping it was made with. Its views
need a pin: they refuse to work for a hit looked up with ``pin=False``
(nothing keeps its slots from being evicted and reused at once), once the hit
was released, or once the mapping was dropped (an epoch change or the client
closing): reading a slot that is not pinned could read another block's
bytes. `Hit.verify` says which copied blocks still held their bytes
(`Verification`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvstore.api.wire import unpack_hashes
from kvstore.checksum import block_checksum, mismatches
from kvstore.client.blocks import slot_runs
from kvstore.client.errors import BlocksMoved, PoolEpochChanged
from kvstore.client.handles import Namespace
from kvstore.client.hit_release import HitRelease
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.pool import HostMapping, PoolMapping
from kvstore.pool.stamps import idents_of
from kvstore.results import MissReason
from kvstore.types import HASH_BYTES, BlockHash, LeaseId, SlotId

if TYPE_CHECKING:
    import torch
    from _typeshed import ReadableBuffer


@dataclass(frozen=True, slots=True)
class BlockLocation:
    """Where one block's bytes are in the node's pool."""

    hash: BlockHash
    """The block's chained hash."""
    slot: SlotId
    """Slot in the namespace's pool."""
    generation: int
    """The slot's generation (stale-handle check on the node)."""
    arena: int
    """Arena of the pool holding the slot."""
    offset: int
    """Byte offset of the slot in that arena."""
    checksum: int = 0
    """Checksum of the bytes its writer wrote (`kvstore.checksum`); 0: none was sent."""


@dataclass(frozen=True, slots=True)
class Verification:
    """What `Hit.verify` found: which copied blocks still held their bytes when checked."""

    intact: int
    """Leading blocks whose slot stamps are unchanged: their copied bytes are the
    blocks' bytes (use these, and only these)."""
    moved: tuple[int, ...]
    """Indices (chain order) of the checked blocks whose stamp moved: rewritten or
    reused since the lookup. Never use their bytes, nor any block's after the first."""
    checked: int
    """Blocks checked (the first ``checked`` of the hit)."""

    @property
    def ok(self) -> bool:
        """True when every checked block is intact."""
        return not self.moved


@dataclass(slots=True, eq=False)
class Hit:
    """The leading READY blocks of a chain, pinned under the client's lease if asked.

    The node's packed reply is kept as it came (the hashes as one bytes
    object, slots and generations as arrays): `blocks`, `hashes` and `chain`
    are built on first access, views only when asked for. Build one with
    `Hit.packed` or `Hit.of_locations`.
    """

    namespace: Namespace
    """The namespace looked up."""
    hit_hashes: bytes
    """The hit blocks' hashes, concatenated (32 bytes each), in chain order."""
    slots: npt.NDArray[np.uint64]
    """Slot of each hit block, in chain order."""
    generations: npt.NDArray[np.uint64]
    """Slot generation of each hit block."""
    hit_tokens: int
    """Tokens covered by the hit blocks."""
    query_tokens: int
    """Tokens in the query."""
    pinned: bool
    """True when the hit blocks are pinned (until `Client.release`)."""
    miss_reason: MissReason
    """Why the run of hits ended."""
    epoch: int
    """Pool epoch of the answer."""
    packed_chain: bytes = b""
    """Every full block's hash of the query, concatenated (when tokens were sent)."""
    slots_per_arena: int = 0
    """Slots per arena of the pool (slot s is in arena s // slots_per_arena)."""
    block_bytes: int = 0
    """Bytes per block (offset in the arena: (s % slots_per_arena) * block_bytes)."""
    mapping: PoolMapping | None = field(default=None, repr=False)
    """The mapping the locations refer to (None when the pool is not mapped)."""
    lease_generation: int = 0
    """Which incarnation of the client's lease holds the pins."""
    lease_id: LeaseId | None = None
    """The lease that holds the pins (None when not pinned): released under it, never
    under a lease that replaced it."""
    release: HitRelease = field(default_factory=HitRelease, repr=False)
    """The release of its pins: its id and where it is (moved by `Client.release`)."""
    pool_version: int = 0
    """The pool's arena set when the node answered (another process reading the
    slots maps at least this version first: `Client.follow_pool`)."""
    checksums: npt.NDArray[np.uint64] = field(
        default_factory=lambda: np.zeros(0, dtype=np.uint64), repr=False
    )
    """Each hit block's checksum of the bytes its writer wrote (`kvstore.checksum`),
    in chain order; 0 where the writer sent none. Empty: a node that sends none."""
    _blocks: tuple[BlockLocation, ...] | None = field(default=None, repr=False)
    _chain: tuple[BlockHash, ...] | None = field(default=None, repr=False)

    @classmethod
    def of_locations(
        cls,
        namespace: Namespace,
        blocks: Sequence[BlockLocation],
        *,
        chain: Sequence[BlockHash] = (),
        **fields: Any,
    ) -> Hit:
        """A hit of per-block locations (the node's unpacked reply)."""
        blocks = tuple(blocks)
        hit = cls(
            namespace=namespace,
            hit_hashes=b"".join(b.hash for b in blocks),
            slots=np.array([b.slot for b in blocks], dtype=np.uint64),
            generations=np.array([b.generation for b in blocks], dtype=np.uint64),
            checksums=np.array([b.checksum for b in blocks], dtype=np.uint64),
            packed_chain=b"".join(chain),
            **fields,
        )
        hit._blocks = blocks
        hit._chain = tuple(chain)
        return hit

    @property
    def released(self) -> bool:
        """True once `Client.release` was called: no views from then on, since the
        node may have dropped the pins."""
        return self.release.released

    @property
    def release_id(self) -> int:
        """The id that names this hit's pins (`HitRelease.release_id`)."""
        return self.release.release_id

    @property
    def hit_blocks(self) -> int:
        """Number of hit blocks."""
        return len(self.slots)

    @property
    def blocks(self) -> tuple[BlockLocation, ...]:
        """Hit blocks from the start of the chain (built on first access)."""
        if self._blocks is None:
            per_arena = self.slots_per_arena
            block_bytes = self.block_bytes
            hashes = self.hit_hashes
            sums = self.checksums
            blocks = []
            for i, (slot, generation) in enumerate(
                zip(self.slots.tolist(), self.generations.tolist(), strict=True)
            ):
                arena, index = divmod(slot, per_arena) if per_arena else (0, slot)
                blocks.append(
                    BlockLocation(
                        BlockHash(hashes[i * HASH_BYTES : (i + 1) * HASH_BYTES]),
                        SlotId(slot),
                        generation,
                        arena,
                        index * block_bytes,
                        int(sums[i]) if i < len(sums) else 0,
                    )
                )
            self._blocks = tuple(blocks)
        return self._blocks

    @property
    def refs(self) -> tuple[BlockLocation, ...]:
        """Alias of `blocks`."""
        return self.blocks

    @property
    def hashes(self) -> list[BlockHash]:
        """Hashes of the hit blocks."""
        return unpack_hashes(self.hit_hashes, "hit_hashes")

    @property
    def chain(self) -> tuple[BlockHash, ...]:
        """Every full block's hash of the query (when tokens were sent; built on first access)."""
        if self._chain is None:
            self._chain = tuple(unpack_hashes(self.packed_chain, "packed_chain"))
        return self._chain

    def _live_mapping(self) -> PoolMapping:
        if self.released:
            raise FailedPrecondition("this hit was released; its slots may hold other blocks now")
        mapping = self.mapping
        if mapping is not None and (mapping.closed or mapping.descriptor.epoch != self.epoch):
            raise PoolEpochChanged(
                "the pool mapping of this hit was dropped (the node restarted or the client "
                "closed); look the blocks up again",
                old=self.epoch,
            )
        if not self.pinned and self.hit_blocks:  # a miss has nothing to read either way
            raise FailedPrecondition(
                "this hit was looked up with pin=False: nothing holds its slots, which may "
                "already hold other blocks; look it up with pin=True to read its blocks"
            )
        if mapping is None:
            raise FailedPrecondition(
                "the pool is not mapped in this process; use Client.read_blocks"
            )
        return mapping

    @property
    def idents(self) -> npt.NDArray[np.uint64]:
        """The stamp ident of each hit block: its hash's first 8 bytes, little-endian."""
        return idents_of(self.hit_hashes)

    @property
    def expected_stamps(self) -> npt.NDArray[np.uint64]:
        """What each hit block's slot stamp must read, ``(hit_blocks, 2)`` uint64:
        the lookup's (READY) generation, then the ident. Compare with
        ``mapping.read_stamps(hit.slots)`` (or use `verify`)."""
        return np.stack([self.generations.astype(np.uint64), self.idents], axis=1)

    def verify(self, count: int | None = None) -> Verification:
        """Check the slot stamps of the first ``count`` hit blocks (all by default).

        Call it **after the copy out of the slots has landed**: host pools
        once the copy returned; CUDA pools once the copy's stream is
        synchronised (``torch.cuda.current_stream().synchronize()``, or
        `PoolMapping.read_fence`'s wait), never on a copy still queued. No
        RPC and no GPU work: the stamps are in host shared memory.

        A block is intact when its stamp still reads the generation the
        lookup answered and its hash's ident: the node moves a slot's stamp
        on before the slot is freed, reused or handed to a writer, and a
        generation never repeats, so an unchanged stamp after the copy means
        the bytes copied were the block's. Pins make a moved block rare;
        this makes it harmless. Valid for a released or unpinned hit too, as
        long as the copy landed before this call.

        Raises:
            InvalidArgument: ``count`` is not in ``[0, hit_blocks]``.
            PoolEpochChanged: the hit's mapping was dropped.
            FailedPrecondition: the pool is not mapped here (or sends no stamps).
        """
        n = self.hit_blocks if count is None else count
        if not 0 <= n <= self.hit_blocks:
            raise InvalidArgument(f"cannot verify {n} of {self.hit_blocks} hit blocks")
        mapping = self.mapping
        if mapping is None:
            raise FailedPrecondition("the pool is not mapped in this process: nothing to verify")
        if mapping.closed or mapping.descriptor.epoch != self.epoch:
            raise PoolEpochChanged(
                "the pool mapping of this hit was dropped; its copies cannot be verified",
                old=self.epoch,
            )
        if n == 0:
            return Verification(0, (), 0)
        moved = mapping.stamps_moved(self.slots[:n], self.generations[:n], self.idents[:n])
        indices = tuple(int(i) for i in moved)
        return Verification(indices[0] if indices else n, indices, n)

    def _slot_ids(self) -> list[SlotId]:
        return self.slots.tolist()  # type: ignore[no-any-return]

    def buffers(self) -> list[memoryview]:
        """Writable zero-copy byte views of the hit blocks, in chain order.

        Raises:
            FailedPrecondition: the hit is not pinned (``pin=False``) or was
                released, or the pool is not mapped here.
            PoolEpochChanged: the mapping was dropped (look the blocks up again).
        """
        mapping = self._live_mapping()
        return [mapping.buffer(slot) for slot in self._slot_ids()]

    def numpy_views(self) -> list[npt.NDArray[np.generic]]:
        """Zero-copy numpy arrays of the hit blocks (``layout.block_shape`` each).

        Copy out of them, then `verify` before using the copies.
        Raises as `buffers` does (a pinned hit only).
        """
        mapping = self._live_mapping()
        layout = self.namespace.layout
        return [mapping.numpy_view(slot, layout) for slot in self._slot_ids()]

    def copy_into(self, out: npt.NDArray[Any]) -> Verification:
        """Copy the hit blocks' bytes into ``out``, in chain order (host pools), and prove them.

        One copy per run of adjacent slots in an arena, not one per block:
        the fastest way to load a hit into the caller's memory. When the
        node's operator wants loads checked (`Namespace.verify_loads`, the
        default), each block is copied and its copy hashed at once, while it
        is in cache, against its writer's checksum (one pass, not a second
        read of every byte). Then the slot stamps are checked (`verify`): a
        block whose stamp moved or whose copy fails its checksum is
        `BlocksMoved`, whose ``intact`` says how many leading blocks of
        ``out`` hold proven bytes (the rest must be recomputed) and whose
        ``corrupt`` the caller reports with its release
        (``Client.release(hit, corrupt=...)``).

        Args:
            out: a writable C-contiguous array of exactly ``hit_blocks``
                blocks' bytes, any dtype and shape (e.g. ``(hit_blocks,
                *layout.block_shape)``).

        Raises:
            InvalidArgument: ``out`` is not such an array.
            FailedPrecondition: the hit is not pinned or was released, the
                pool is not mapped, or it is a CUDA pool (use `torch_views`).
            BlocksMoved: a block's stamp moved during the copy (see above).

        Returns:
            The verification (every block intact).
        """
        mapping = self._live_mapping()
        if not isinstance(mapping, HostMapping):
            raise FailedPrecondition("copy_into copies out of host pools; use torch_views")
        descriptor = mapping.descriptor
        block_bytes, spa = descriptor.block_bytes, descriptor.slots_per_arena
        if not isinstance(out, np.ndarray) or not out.flags.c_contiguous:
            raise InvalidArgument("copy_into needs a C-contiguous numpy array")
        if not out.flags.writeable:
            raise InvalidArgument("copy_into needs a writable array")
        slots = [int(s) for s in self._slot_ids()]
        if out.nbytes != len(slots) * block_bytes:
            raise InvalidArgument(
                f"{len(slots)} blocks are {len(slots) * block_bytes} bytes, "
                f"the array is {out.nbytes}"
            )
        target = out.reshape(-1).view(np.uint8).data
        sums = self.checksums.tolist() if self.namespace.verify_loads else []
        corrupt: list[int] = []
        starts = slot_runs(slots, range(len(slots)), spa)
        for a, b in itertools.pairwise(starts):
            offset = slots[a] % spa * block_bytes
            arena = mapping.arena_buffer(slots[a] // spa)
            if not any(sums[a:b]):  # nothing to check: one copy per run
                size = (b - a) * block_bytes
                target[a * block_bytes : a * block_bytes + size] = arena[offset : offset + size]
                continue
            for i in range(a, b):  # each block's copy hashed while it is in cache
                at, where = i * block_bytes, offset + (i - a) * block_bytes
                copy = target[at : at + block_bytes]
                copy[:] = arena[where : where + block_bytes]
                if sums[i] and block_checksum(copy) != sums[i]:
                    corrupt.append(i)
        verification = self.verify()
        if not verification.ok or corrupt:
            bad = sorted({*verification.moved, *corrupt})
            raise BlocksMoved(
                f"{len(bad)} of {len(slots)} copied blocks were rewritten or reused during "
                f"the copy, or do not have their writer's checksum (first at {bad[0]}): "
                "recompute from there",
                min(verification.intact, bad[0]),
                verification.moved,
                tuple(corrupt),
            )
        return verification

    def check_bytes(self, buffers: Sequence[ReadableBuffer] | None = None) -> list[int]:
        """Indices of the hit blocks whose bytes do not have their writer's checksum.

        Call it after the copy out of the pool has landed (and before the
        release, so the slots still hold what was copied): a block listed
        must not be used (treat it and every later block as a miss); report
        it with the release (``Client.release(hit, corrupt=...)``) so the node
        drops it instead of serving it to every later load. With
        ``buffers`` (one per hit block, in chain order: the caller's copies,
        or `Client.read_blocks`' bytes) those are checked; without, the
        pool's slots through this hit's mapping (host pools). A block whose
        checksum is 0 (its writer sent none, e.g. a CUDA pool's) is never
        listed. Runs when asked; `Namespace.verify_loads` says whether the
        node's operator wants every load checked.

        Raises:
            InvalidArgument: ``buffers`` is not one buffer per hit block.
            FailedPrecondition: without ``buffers``: as `buffers` does, or a
                CUDA pool (pass host copies).
        """
        sums = self.checksums.tolist() if len(self.checksums) else []
        if not any(sums):
            return []
        if buffers is None:
            mapping = self._live_mapping()
            if not isinstance(mapping, HostMapping):
                raise FailedPrecondition("check_bytes of a CUDA pool needs host copies (buffers)")
            buffers = [mapping.buffer(slot) for slot in self._slot_ids()]
        elif len(buffers) != len(sums):
            raise InvalidArgument(f"{len(sums)} hit blocks, {len(buffers)} buffers to check")
        return mismatches(buffers, sums)

    def torch_views(self) -> list[torch.Tensor]:
        """Zero-copy tensors of the hit blocks, with the layout's dtype and shape.

        CPU tensors for a host pool; tensors on the pool's GPU for a CUDA pool.
        Copy out of them, synchronise the copy, then `verify` before using it.
        Raises as `buffers` does (a pinned hit only).
        """
        mapping = self._live_mapping()
        layout = self.namespace.layout
        return [mapping.torch_view(slot, layout) for slot in self._slot_ids()]
