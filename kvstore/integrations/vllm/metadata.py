"""What the scheduler side tells the workers each step, and what they report back.

Without vLLM installed the classes derive from plain bases, so the copy
paths (`WorkerSide`, `SchedulerSide`) can be unit-tested in an environment
without vLLM; inside vLLM they are its metadata types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # unit tests without vLLM

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's base class."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's base class."""


from kvstore.client import Hit
from kvstore.types import BlockHash


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Copy pinned pool slots into a request's vLLM blocks (asynchronously, in the worker)."""

    request_id: str
    block_ids: tuple[int, ...]
    """vLLM block ids to fill, in chain order."""
    slots: tuple[int, ...]
    """The node's pool slots holding them (pinned by the scheduler until the load is reported)."""
    epoch: int
    """Pool epoch of the lookup: a worker mapping of another epoch must not read the slots."""
    pins_until: float
    """This host's ``time.monotonic()`` until which the pins are surely held (0: they are not):
    a copy that did not finish before it is reported failed, never used."""
    pool_version: int = 0
    """The pool's arena set at the lookup: the worker maps at least this one first."""
    unit: int = 0
    """The namespace holding the slots (`units`: a KV cache group, one rank's share or
    every rank's): copied by the workers of the ranks it holds KV for."""
    stamps: tuple[tuple[int, int], ...] = ()
    """Per slot, the stamp it had at the lookup, (generation, ident) (`kvstore.pool.stamps`):
    the worker reads the slots' stamps again once its copy has landed, and a block whose
    stamp moved is a load error (vLLM recomputes it), whatever the pins said."""
    checksums: tuple[int, ...] = ()
    """Per slot, the writer's checksum (0: none): checked after the copy when the node
    asks for full verification (``verify_checksums = "all"``)."""


NULL_BLOCK = 0
"""vLLM's null block id: a block a sliding-window group does not keep (outside the window)."""


def plan_loads(
    request_id: str,
    hits: Sequence[Hit],
    block_ids: Sequence[Sequence[int]],
    first: int,
    last: int,
) -> list[LoadSpec]:
    """One load per unit: hit blocks ``first`` to ``last`` into that unit's vLLM block ids
    (``block_ids[unit]``), skipping the null blocks of a sliding window (vLLM keeps only
    the window's blocks: only those are copied). ``pins_until`` is filled in when the
    step is sent."""
    loads = []
    for unit, (hit, ids) in enumerate(zip(hits, block_ids, strict=True)):
        wanted = np.asarray(ids[first:last], dtype=np.int64)
        keep = np.flatnonzero(wanted != NULL_BLOCK) + first
        loads.append(
            LoadSpec(
                request_id=request_id,
                block_ids=tuple(wanted[keep - first].tolist()),
                slots=tuple(hit.slots[keep].tolist()),
                epoch=hit.epoch,
                pins_until=0.0,
                pool_version=hit.pool_version,
                unit=unit,
                stamps=tuple((int(g), int(i)) for g, i in hit.expected_stamps[keep].tolist()),
                checksums=tuple(hit.checksums[keep].tolist()) if len(hit.checksums) else (),
            )
        )
    return loads


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store a request's newly completed full blocks, after this step's forward."""

    request_id: str
    hashes: tuple[BlockHash, ...]
    """Chain hashes of every full block from block 0 up to the last one to save."""
    block_ids: tuple[int, ...]
    """vLLM block ids of those blocks, one per hash."""
    first_new: int
    """Index of the first block copied out (the likely writes); the node should have the
    blocks before it. If it lost one, the save is given up and planned again from 0."""
    frees_blocks: bool = False
    """The request has finished and vLLM keeps its blocks until this save is copied out:
    the worker reports it in ``finished_sending`` (whether it copied, skipped or failed)."""
    unit: int = 0
    """The namespace the hashes are of (`units`): saved by that unit's saver rank only."""


@dataclass(slots=True)
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    failures_seen: int = 0
    """The highest worker failure number (`KVStoreWorkerReport.failure_seq`) the scheduler
    had processed when it built this step: saves of this step already account for it."""
    idle: bool = False
    """This step runs no forward (no tokens scheduled): loads are copied in
    `start_load_kv` itself, where nothing waits on the step and the copy has
    the host to itself, and are reported at this step's end."""


@dataclass(slots=True)
class KVStoreWorkerReport(KVConnectorWorkerMetadata):
    """What a worker finished since its last report (the scheduler side acts on it)."""

    loaded: set[tuple[str, int]] = field(default_factory=set)
    """(request, rank) whose loads (every unit that rank copies) finished on that rank,
    done or failed: the pins of units no other rank still copies may be released."""
    failed_loads: set[tuple[str, int]] = field(default_factory=set)
    """(request, rank) whose load failed (vLLM recomputes their blocks)."""

    failed_blocks: set[int] = field(default_factory=set)
    """vLLM block ids whose load failed: no request holding one is saved until recomputed."""
    failure_seq: int = 0
    """Number of the worker's latest load failure (0: none yet)."""
    saved: dict[tuple[str, int], int] = field(default_factory=dict)
    """Per (request, unit): leading full blocks the node now has (a confirmed commit)."""
    unsaved: dict[str, bool] = field(default_factory=dict)
    """Per request: a save that did not happen (or only its first part, `saved`, within
    the byte budget); True when it must start again from block 0."""
    poisoned: set[str] = field(default_factory=set)
    """Requests whose save was refused: their blocks touch a failed load's blocks."""
    corrupt: dict[tuple[str, int], tuple[int, ...]] = field(default_factory=dict)
    """Per (request, unit): pool slots whose bytes failed their writer's checksum in this
    worker's load: reported with the unit's release, so the node drops those blocks."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Union of two workers' reports."""
        if not isinstance(other, KVStoreWorkerReport):
            return self
        unsaved = dict(self.unsaved)
        for req_id, restage in other.unsaved.items():
            unsaved[req_id] = restage or unsaved.get(req_id, False)
        return KVStoreWorkerReport(
            loaded=self.loaded | other.loaded,
            failed_loads=self.failed_loads | other.failed_loads,
            failed_blocks=self.failed_blocks | other.failed_blocks,
            failure_seq=max(self.failure_seq, other.failure_seq),
            saved=self.saved | other.saved,  # each unit is saved by one rank
            unsaved=unsaved,
            poisoned=self.poisoned | other.poisoned,
            corrupt={
                key: tuple(sorted({*self.corrupt.get(key, ()), *other.corrupt.get(key, ())}))
                for key in self.corrupt.keys() | other.corrupt.keys()
            },
        )
