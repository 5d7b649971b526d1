"""The per-block hot loop of a reservation: one pass over the chain.

`kvstore.block_table` decides what a reservation means (`BlockTable.reserve`:
which lease, which scope, the events it emits); the loop that runs once per
block of the chain lives here, as the loops of lookup and release live in
`kvstore.pins`. Per block, in order: READY → HIT (pinned for the call, so
reserving a tail never evicts its own prefix); WRITING under another lease →
IN_FLIGHT; WRITING under this lease → RESERVED again (idempotent); absent →
a new WRITING block in a slot taken ahead in runs (`Residency.allocate_run`),
or NO_ROOM for it and every later block.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.block import Block, BlockState
from kvstore.lease import Lease
from kvstore.residency import Residency
from kvstore.results import ReserveResult, ReserveStatus
from kvstore.types import BlockHash, SlotId, TenantId


def reserve_walk(
    res: Residency,
    lease: Lease,
    writes: set[Block],
    scope: TenantId,
    chain: Sequence[BlockHash],
    now: float,
    removed: list[Block],
) -> ReserveResult:
    """Reserve the blocks of ``chain`` that nobody has, for ``lease`` in ``scope``.

    Args:
        res: the namespace's slots, blocks and LRU.
        lease: the writer; new blocks are WRITING under it.
        writes: the lease's WRITING blocks of this namespace (new ones are added).
        scope: the scope the blocks live in (`BlockTable.scope_of`).
        chain: block hashes from the first block of the prompt on (checked by the caller).
        now: current time.
        removed: blocks evicted to make room are appended here, also when the
            walk raises (the caller emits their REMOVED events).
    """
    writer = lease.lease_id
    statuses: list[ReserveStatus] = []
    slots: list[int] = []
    generations: list[int] = []
    protected: list[Block] = []
    seen: set[Block] = set()
    prev: Block | None = None
    fresh: list[Block] = []  # the new blocks, in chain order
    fresh_at: list[int] = []  # their indexes in the chain
    taken: list[SlotId] = []  # slots taken ahead for the next new blocks, last first
    try:
        for depth, h in enumerate(chain):
            block = res.find(scope, h)
            if block is not None:
                if block.parent is not prev and block not in seen:
                    block.parent = prev  # a repeated hash: never its own ancestor
                if block.state is BlockState.READY:
                    res.pin(block)
                    protected.append(block)
                    status = ReserveStatus.HIT
                elif block.writer == writer:
                    status = ReserveStatus.RESERVED
                else:
                    status = ReserveStatus.IN_FLIGHT
                placed = status is not ReserveStatus.IN_FLIGHT
                statuses.append(status)
                slots.append(block.slot if placed else 0)
                generations.append(block.generation if placed else 0)
                seen.add(block)
                prev = block
                continue
            if not taken:
                taken = res.allocate_run(scope, chain, depth, removed, now)
                if not taken:
                    n = len(chain) - depth
                    statuses.extend([ReserveStatus.NO_ROOM] * n)
                    slots.extend([0] * n)
                    generations.extend([0] * n)
                    break
                taken.reverse()
            slot = taken.pop()
            # hash, scope, slot, generation, parent, depth, state, writer,
            # refcount, hits, last_used, created (positional: the hot loop)
            block = Block(
                h, scope, slot, res.hand_to_writer(slot), prev, depth,
                BlockState.WRITING, writer, 0, 0, now, now,
            )  # fmt: skip
            res.add_writing(block)
            writes.add(block)
            fresh.append(block)
            fresh_at.append(depth)
            statuses.append(ReserveStatus.RESERVED)
            slots.append(slot)
            generations.append(block.generation)
            seen.add(block)
            prev = block
        if taken:  # taken ahead for hashes that were repeats after all
            res.untake(taken)
        if res.ascending_slots(fresh):
            for index, block in zip(fresh_at, fresh, strict=True):
                slots[index] = block.slot
                generations[index] = block.generation
    finally:
        for block in protected:
            res.unpin(block)
        res.touch(protected, now)
    return ReserveResult(chain, statuses, slots, generations)
