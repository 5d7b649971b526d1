"""The per-block hot loops of lookup, pin and release, one pass each.

`kvstore.block_table` decides what a lookup or a release means; the loops
that run once per block of a chain live here, written so that a block
costs a small multiple of a dict lookup: no call per block, no object per
block, no LRU operation for a pin.

- A lookup walks the chain through the scope's dict (`walk`, the look-ups
  in C; the hashes are validated only when one is not found) and, with a
  lease, adds one pin per hit (`pin_run`): the block's ``refcount``, and
  the lease's set of pinned blocks in one bulk update (a second pin of a
  block by the same lease is counted in ``Lease.extra_pins``). Pinned
  blocks stay where they are in the LRU (`kvstore.eviction` skips them).
- A release drops the lease's pins (`unpin_hashes`: one bulk set operation
  when every named block is pinned once) and then touches the
  released blocks once: when they are a chain from its first block (the
  usual release of what a lookup pinned) that touch is a single pass over
  the run (`Residency.touch_prefix`), not an ancestor walk.
- The result carries arrays of slots and generations (`lookup_result`).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import cast

from kvstore.block import Block, BlockState
from kvstore.lease import Lease
from kvstore.residency import Residency
from kvstore.results import LookupResult, MissReason
from kvstore.types import BlockHash, NamespaceId, check_hashes

_READY = BlockState.READY


def find_all(blocks: dict[BlockHash, Block], hashes: Sequence[BlockHash]) -> list[Block | None]:
    """``blocks.get`` of every hash, in C; `InvalidArgument` if one is not a block hash.

    The hashes are checked only when one is not found: the dict's keys are
    all well-formed hashes, so a hash that is found is one. A malformed hash
    raises as `check_hashes` would, wherever it sits in the list.
    """
    try:
        found = list(map(blocks.get, hashes))
    except TypeError:  # unhashable: not bytes
        check_hashes(hashes)
        raise
    if None in found:
        check_hashes(hashes)
    return found


def walk(
    blocks: dict[BlockHash, Block], chain: Sequence[BlockHash]
) -> tuple[list[Block], MissReason]:
    """The longest run of READY blocks from the start of ``chain``, and why it ended.

    A hit whose parent record is not the previous hit (the parent was
    evicted and stored again, or the blocks were reserved as separate
    pieces) is relinked to it: the hash proves it is the chain's parent.
    Raises `InvalidArgument` if an item of ``chain`` is not a block hash.
    """
    found = find_all(blocks, chain)
    prev: Block | None = None
    for n, block in enumerate(found):
        if block is None or block.state is not _READY:
            reason = MissReason.ABSENT if block is None else MissReason.IN_FLIGHT
            return cast("list[Block]", found[:n]), reason
        if block.parent is not prev:
            return _walk_relinking(found, n)
        prev = block
    return cast("list[Block]", found), MissReason.NONE


def _walk_relinking(found: list[Block | None], start: int) -> tuple[list[Block], MissReason]:
    """`walk` from ``start`` on, where parent links need repair (rare: a slower loop).

    A block met twice in one chain (a hash repeated: no real chain does
    that) ends the run instead of being relinked, which would make it its
    own ancestor.
    """
    seen = set(found[:start])
    prev = found[start - 1] if start else None
    for n in range(start, len(found)):
        block = found[n]
        if block is None or block.state is not _READY or block in seen:
            reason = (
                MissReason.IN_FLIGHT
                if block is not None and block not in seen
                else MissReason.ABSENT
            )
            return cast("list[Block]", found[:n]), reason
        if block.parent is not prev:
            block.parent = prev
        seen.add(block)
        prev = block
    return cast("list[Block]", found), MissReason.NONE


def pin_run(
    res: Residency, lease: Lease, namespace: NamespaceId, hits: list[Block], now: float | None
) -> None:
    """One more pin on every block of ``hits`` under ``lease``.

    The block's ``refcount`` takes it; the lease records it in its set in
    one bulk update (a block it already pins goes to its extra counts
    instead). With ``now`` (not a peek) each hit also counts the lookup
    (``hits``, ``last_used``) in the same pass.
    """
    first = 0
    if now is None:
        for block in hits:
            if not block.refcount:
                first += 1
            block.refcount += 1
    else:
        for block in hits:
            if not block.refcount:
                first += 1
            block.refcount += 1
            block.hits += 1
            block.last_used = now
    res.pinned += first
    pinned = lease.pins_in(namespace)
    if pinned.isdisjoint(hits):
        before = len(pinned)
        pinned.update(hits)
        if len(pinned) - before == len(hits):
            return
        pinned.difference_update(hits)  # a block twice in hits: undo, count one by one
    extra = lease.extra_pins.setdefault(namespace, {})
    for block in hits:
        if block in pinned:
            extra[block] = extra.get(block, 0) + 1
        else:
            pinned.add(block)
    if not extra:
        del lease.extra_pins[namespace]


def unpin_hashes(
    res: Residency,
    lease: Lease,
    namespace: NamespaceId,
    blocks: dict[BlockHash, Block],
    hashes: Sequence[BlockHash],
) -> tuple[list[Block], bool]:
    """Drop one of the lease's pins on each named block it pins.

    Returns the blocks released, and whether they form a chain from its
    first block (each the parent of the next), so one `touch_prefix` pass
    is enough to mark them used. A block the lease does not pin is skipped:
    another lease's pins are never touched, no count goes below zero.
    Raises `InvalidArgument` (nothing released) if an item of ``hashes`` is
    not a block hash.

    The usual release (every named block pinned once by this lease, none
    named twice) drops the lease's pins in one bulk set operation; any
    other falls back to one block at a time.
    """
    # An absent hash (None) is in no set below, so it is skipped like an unpinned block.
    found = cast("list[Block]", find_all(blocks, hashes))
    pinned = lease.pins.get(namespace)
    if pinned is None:
        return [], True
    extra = lease.extra_pins.get(namespace)
    if extra is None and pinned.issuperset(found):
        before = len(pinned)
        pinned.difference_update(found)
        if before - len(pinned) == len(found):
            return found, _unpin_run(res, found)
        pinned.update(found)  # a block named twice: undo (all were pinned), go one by one
    released: list[Block] = []
    for block in found:
        if block not in pinned:
            continue
        more = extra.get(block) if extra is not None else None
        if more is None:
            pinned.discard(block)
        elif more == 1:
            del extra[block]  # type: ignore[union-attr]
        else:
            extra[block] = more - 1  # type: ignore[index]
        released.append(block)
    if extra is not None and not extra:
        del lease.extra_pins[namespace]
    return released, _unpin_run(res, released)


def _unpin_run(res: Residency, released: list[Block]) -> bool:
    """Drop one pin from each block's refcount; True when they are a chain from its start."""
    last = 0
    prefix = True
    prev: Block | None = None
    for block in released:
        # The lease's own pin is part of the refcount: it stays >= 0.
        block.refcount -= 1
        if not block.refcount:
            last += 1
        if block.parent is not prev:
            prefix = False
        prev = block
    res.pinned -= last
    return prefix


def keep_checksums(
    blocks: dict[BlockHash, Block], hashes: Sequence[BlockHash], checksums: Sequence[int]
) -> None:
    """Give each WRITING block of ``hashes`` its writer's checksum (``checksums[i]``, 0:
    none sent; `kvstore.checksum`) before its commit; a READY block keeps its own.

    ``checksums`` empty: none were sent, nothing changes.
    """
    if not checksums:
        return
    for h, checksum in zip(hashes, checksums, strict=True):
        block = blocks[h]
        if block.state is BlockState.WRITING:
            block.checksum = checksum


def lookup_result(
    chain: Sequence[BlockHash], hits: list[Block], pinned: bool, reason: MissReason
) -> LookupResult:
    """The result of a lookup that found ``hits`` (a prefix of ``chain``)."""
    return LookupResult(
        hashes=tuple(chain[: len(hits)]),
        slots=array("q", [b.slot for b in hits]),  # a list first: faster than a map
        generations=array("Q", [b.generation for b in hits]),
        checksums=array("Q", [b.checksum for b in hits]),
        pinned=pinned,
        miss_reason=reason,
    )
