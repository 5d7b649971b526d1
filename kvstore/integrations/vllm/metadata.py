"""What the scheduler side tells the workers each step, and what they report back.

Without vLLM installed the classes derive from plain bases, so the copy
paths (`WorkerSide`, `SchedulerSide`) can be unit-tested in an environment
without vLLM; inside vLLM they are its metadata types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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
    rank: int = 0
    """The tensor-parallel rank whose namespace holds the slots (the only worker to copy)."""
    stamps: tuple[tuple[int, int], ...] = ()
    """Per slot, the stamp it had at the lookup, (generation, ident) (`kvstore.pool.stamps`):
    the worker reads the slots' stamps again once its copy has landed, and a block whose
    stamp moved is a load error (vLLM recomputes it), whatever the pins said."""
    checksums: tuple[int, ...] = ()
    """Per slot, the writer's checksum (0: none): checked after the copy when the node
    asks for full verification (``verify_checksums = "all"``)."""


def plan_loads(
    request_id: str, hits: Sequence[Hit], block_ids: Sequence[int], first: int, last: int
) -> list[LoadSpec]:
    """One load per rank: hit blocks ``first`` to ``last`` into vLLM's ``block_ids`` there
    (``pins_until`` is filled in when the step is sent)."""
    return [
        LoadSpec(
            request_id=request_id,
            block_ids=tuple(block_ids[first:last]),
            slots=tuple(hit.slots[first:last].tolist()),
            epoch=hit.epoch,
            pins_until=0.0,
            pool_version=hit.pool_version,
            rank=rank,
            stamps=expected_stamps(hit, first, last),
            checksums=tuple(hit.checksums[first:last].tolist()) if len(hit.checksums) else (),
        )
        for rank, hit in enumerate(hits)
    ]


def expected_stamps(hit: Hit, first: int, last: int) -> tuple[tuple[int, int], ...]:
    """The stamps blocks ``first`` to ``last`` of ``hit`` must still have after a copy."""
    return tuple((int(g), int(i)) for g, i in hit.expected_stamps[first:last].tolist())


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
    rank: int = 0
    """The tensor-parallel rank whose namespace the hashes are of (the only worker to save)."""


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
    """(request, rank) whose load finished on that rank, done or failed: that rank's pins
    may be released (another rank of the same request may still be copying)."""
    failed_loads: set[tuple[str, int]] = field(default_factory=set)
    """(request, rank) whose load failed (vLLM recomputes their blocks)."""

    failed_blocks: set[int] = field(default_factory=set)
    """vLLM block ids whose load failed: no request holding one is saved until recomputed."""
    failure_seq: int = 0
    """Number of the worker's latest load failure (0: none yet)."""
    saved: dict[tuple[str, int], int] = field(default_factory=dict)
    """Per (request, rank): leading full blocks the node now has (a confirmed commit)."""
    unsaved: dict[str, bool] = field(default_factory=dict)
    """Per request: a save that did not happen; True when it must start again from block 0."""
    poisoned: set[str] = field(default_factory=set)
    """Requests whose save was refused: their blocks touch a failed load's blocks."""

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
            saved=self.saved | other.saved,  # each rank reports its own keys
            unsaved=unsaved,
            poisoned=self.poisoned | other.poisoned,
        )
