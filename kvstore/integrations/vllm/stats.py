"""The connector's load counters on vLLM's own ``/metrics`` (and its periodic log line).

Each worker counts, per step, the blocks it loaded and proved, and the
blocks it reported as load errors by reason; vLLM sends the counts to its
logger process (`KVConnectorStats`), and the counters appear as
``vllm:kvstore_loaded_blocks_total``, ``vllm:kvstore_load_error_blocks_total``
(all load errors) and, by reason, ``vllm:kvstore_load_moved_blocks_total``
(a slot's stamp moved during its copy) and
``vllm:kvstore_load_checksum_failed_blocks_total`` (full verification found
other bytes than the writer's). An operator reads a rising error counter as
"recomputes instead of wrong tokens".

Without vLLM installed the classes derive from plain bases, so the counts
can be unit-tested; the Prometheus part is only built inside vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError:  # unit tests without vLLM

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        """Stand-in for vLLM's base class."""

        data: dict[str, Any] = field(default_factory=dict)

    class KVConnectorPromMetrics:  # type: ignore[no-redef]
        """Stand-in for vLLM's base class."""


COUNTS = {
    "loaded_blocks": "Blocks loaded from the kvstore node and proven by their slot stamps.",
    "load_error_blocks": "Blocks reported to vLLM as load errors (vLLM recomputed them).",
    "load_moved_blocks": "Load errors: the slot's stamp moved while the block was copied.",
    "load_checksum_failed_blocks": "Load errors: the bytes did not match the writer's checksum.",
}
"""Counter name (after ``vllm:kvstore_``) -> its help text."""


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Block counts since the last report (`COUNTS`), summed over workers and steps."""

    def __post_init__(self) -> None:
        for name in COUNTS:
            self.data.setdefault(name, 0)

    def add(self, name: str, blocks: int) -> None:
        """Count ``blocks`` under ``name`` (one of `COUNTS`)."""
        self.data[name] += blocks

    def reset(self) -> None:
        """Back to zero."""
        self.data = dict.fromkeys(COUNTS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add another worker's (or step's) counts."""
        for name in COUNTS:
            self.data[name] += int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counts, for vLLM's periodic log line."""
        return {f"kvstore {name.replace('_', ' ')}": self.data[name] for name in COUNTS}

    def is_empty(self) -> bool:
        """True when nothing was counted."""
        return not any(self.data[name] for name in COUNTS)


class KVStorePromMetrics(KVConnectorPromMetrics):
    """The counters of `COUNTS` on vLLM's ``/metrics``, one per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvstore_{name}", documentation=doc, labelnames=labelnames
                ),
                self.per_engine_labelvalues,
            )
            for name, doc in COUNTS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counts to the engine's counters."""
        for name, per_engine in self.counters.items():
            blocks = int(transfer_stats_data.get(name, 0))
            if blocks:
                per_engine[engine_idx].inc(blocks)
