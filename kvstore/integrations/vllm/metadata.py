"""What the scheduler side tells the workers each step, and what they report back.

Without vLLM installed the classes derive from plain bases, so the copy
paths (`WorkerSide`, `SchedulerSide`) can be unit-tested in an environment
without vLLM; inside vLLM they are its metadata types.
"""

from __future__ import annotations

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


from kvstore.types import BlockHash


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Copy pinned pool slots into a request's vLLM blocks, before this step's forward."""

    request_id: str
    block_ids: tuple[int, ...]
    """vLLM block ids to fill, in chain order."""
    slots: tuple[int, ...]
    """The node's pool slots holding them (pinned by the scheduler until the load is done)."""
    epoch: int
    """Pool epoch of the lookup: a worker mapping of another epoch must not read the slots."""
    valid: bool = True
    """False when the pins were lost before the step (lease lost): report the blocks failed."""
    pool_version: int = 0
    """The pool's arena set at the lookup: the worker maps at least this one first."""


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store a request's newly completed full prompt blocks, after this step's forward."""

    request_id: str
    hashes: tuple[BlockHash, ...]
    """Chain hashes of every full block from block 0 up to the last one to save."""
    block_ids: tuple[int, ...]
    """vLLM block ids of those blocks, one per hash."""
    first_new: int
    """Index of the first block not known to be on the node (the likely writes)."""


@dataclass(slots=True)
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(slots=True)
class KVStoreWorkerReport(KVConnectorWorkerMetadata):
    """Requests whose loads a worker finished this step (their pins may be released)."""

    loaded: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Union of two workers' reports."""
        if isinstance(other, KVStoreWorkerReport):
            return KVStoreWorkerReport(self.loaded | other.loaded)
        return self
