"""The per-block hot loops of lookup, pin and release, one pass each.

`kvstore.block_table` decides what a lookup or a release means; the loops
that run once per block of a chain live here, written so that a block
costs a small multiple of a dict lookup: no call per block, no object per
block, no LRU operation for a pin.

- A lookup walks the chain through the scope's dict (`walk`) and, with a
  lease, adds one pin per hit (`pin_run`): the block's ``refcount`` and the
  lease's own count. Pinned blocks stay where they are in the LRU
  (`kvstore.eviction` skips them).
- A release drops the lease's pins (`unpin_hashes`) and then touches the
  released blocks once: when they are a chain from its first block (the
  usual release of what a lookup pinned) that touch is a single pass over
  the run (`Residency.touch_prefix`), not an ancestor walk.
- The result carries arrays of slots and generations (`lookup_result`).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvstore.block import Block, BlockState
from kvstore.residency import Residency
from kvstore.results import LookupResult, MissReason
from kvstore.types import BlockHash

_READY = BlockState.READY


def walk(blocks: dict[BlockHash, Block], chain: Sequence[BlockHash]) -> tuple[list[Block], MissReason]:
    """The longest run of READY blocks from the start of ``chain``, and why it ended.

    A hit whose parent record was replaced (evicted, then stored again) is
    relinked to the live one: the hash proves it is the chain's parent.
    """
    hits: list[Block] = []
    get = blocks.get
    prev: Block | None = None
    for h in chain:
        block = get(h)
        if block is None:
            return hits, MissReason.ABSENT
        if block.state is not _READY:
            return hits, MissReason.IN_FLIGHT
        if block.parent is not prev:
            block.parent = prev
        hits.append(block)
        prev = block
    return hits, MissReason.NONE


def pin_run(res: Residency, pins: dict[Block, int], hits: list[Block]) -> None:
    """One more pin on every block of ``hits``, counted in the lease's ``pins`` too."""
    first = 0
    get = pins.get
    for block in hits:
        if not block.refcount:
            first += 1
        block.refcount += 1
        pins[block] = get(block, 0) + 1
    res.pinned += first


def unpin_hashes(
    res: Residency,
    pins: dict[Block, int],
    blocks: dict[BlockHash, Block],
    hashes: Sequence[BlockHash],
) -> tuple[list[Block], bool]:
    """Drop one of the lease's pins on each named block it pins.

    Returns the blocks released, and whether they form a chain from its
    first block (each the parent of the next), so one `touch_prefix` pass
    is enough to mark them used. A block the lease does not pin is skipped:
    another lease's pins are never touched, no count goes below zero.
    """
    released: list[Block] = []
    last = 0
    prefix = True
    prev: Block | None = None
    bget, pget = blocks.get, pins.get
    for h in hashes:
        block = bget(h)
        count = pget(block) if block is not None else None
        if count is None:
            continue
        if count == 1:
            del pins[block]
        else:
            pins[block] = count - 1
        # The lease's own pin is part of the refcount: it stays >= 0.
        block.refcount -= 1
        if not block.refcount:
            last += 1
        if block.parent is not prev:
            prefix = False
        prev = block
        released.append(block)
    res.pinned -= last
    return released, prefix


def lookup_result(
    chain: Sequence[BlockHash], hits: list[Block], pinned: bool, reason: MissReason
) -> LookupResult:
    """The result of a lookup that found ``hits`` (a prefix of ``chain``)."""
    return LookupResult(
        hashes=tuple(chain[: len(hits)]),
        slots=array("q", [b.slot for b in hits]),
        generations=array("Q", [b.generation for b in hits]),
        pinned=pinned,
        miss_reason=reason,
    )
