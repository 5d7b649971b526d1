"""`KVStoreConnector`: vLLM's KV connector (v1) backed by a kvstore cache node.

vLLM makes one instance per role: the scheduler's (in the engine-core
process) and one per worker. Each owns its own client and lease on the
node; this class only routes vLLM's hooks to `SchedulerSide` or
`WorkerSide`. See `docs/vllm.md` for the configuration and the design.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.identity import (
    block_order,
    kv_groups,
    namespace_model_id,
    tp_size,
)
from kvstore.integrations.vllm.logs import follow_vllm_logging
from kvstore.integrations.vllm.metadata import KVStoreConnectorMetadata
from kvstore.integrations.vllm.node_link import NodeLink
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.shutdown import on_stop
from kvstore.integrations.vllm.stats import KVStoreConnectorStats, KVStorePromMetrics
from kvstore.integrations.vllm.units import engine_units, unit_copies
from kvstore.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """Loads cached prefixes from a kvstore node and saves new full blocks to it.

    Every KV cache group of a model is cached on its own (`units`), so vLLM keeps
    its hybrid KV cache manager on (`SupportsHMA`).
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        """Read the config and derive the namespace; registering it starts in the background.

        Raises:
            InvalidArgument: an unknown or ill-typed setting, or a model the
                connector cannot cache (Mamba or linear-attention state, encoder
                KV, pipeline parallelism: the message says which and why).
        """
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        follow_vllm_logging()  # else these lines never reach `vllm serve`'s log
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.config = ConnectorConfig.from_extra(extra)
        groups = kv_groups(kv_cache_config)
        model_id = namespace_model_id(vllm_config, groups[0].layout, self.config.model_id)
        tp = tp_size(vllm_config)
        units = engine_units(groups, model_id, tp)
        is_scheduler = role == KVConnectorRole.SCHEDULER
        rank = 0
        if is_scheduler:
            self._recompute_failed_loads()
        elif tp > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        # The scheduler looks up and pins every unit's blocks; a worker those it copies.
        copies = unit_copies(units, rank)
        linked = units if is_scheduler else [units[copy.unit] for copy in copies]
        link = NodeLink(
            self.config,
            [unit.model_id for unit in linked],
            [unit.group.layout for unit in linked],
            client_name=f"vllm-{'scheduler' if is_scheduler else 'worker'}",
            map_pool=not is_scheduler,
        )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if is_scheduler:
            self._scheduler = SchedulerSide(
                link,
                groups[0].layout.block_size,
                load=self.config.load,
                save=self.config.save,
                save_decode=self.config.save_decode,
                extra_keys=generate_block_hash_extra_keys,
                units=units,
                tp=tp,
            )
            # Register now, in the background: the first request must not pay for it
            # (on a busy host it can take longer than `lookup_timeout`).
            link.namespace()
        else:
            self._worker = WorkerSide(
                link,
                groups[0].layout,
                groups[0].layer_names,
                fail_loads=self.config.fail_loads,
                max_pending_save_bytes=self.config.max_pending_save_bytes,
                rank=rank,
                order=block_order(vllm_config),
                units=copies,
                request_level_errors=len(groups) > 1,
            )
        # End the leases at once on SIGTERM, SIGINT or exit (docs/vllm.md, "Stopping").
        on_stop(self.shutdown)
        log.info(
            "kvstore connector (%s) for %s, block %d tokens, %s, node %s",
            "scheduler" if is_scheduler else f"worker {rank} of {tp}",
            model_id,
            groups[0].layout.block_size,
            ", ".join(f"group {g.index} {g.kind}" for g in groups),
            self.config.target,
        )

    def _recompute_failed_loads(self) -> None:
        """A cache miss must cost a recompute, never the request: vLLM's default policy
        for failed loads is to fail the request, so switch it (the scheduler reads it
        right after making this connector)."""
        config = self._kv_transfer_config
        if getattr(config, "kv_load_failure_policy", "recompute") == "recompute":
            return
        try:
            config.kv_load_failure_policy = "recompute"
        except (AttributeError, TypeError, ValueError) as exc:
            log.warning(
                "kvstore connector: set kv_load_failure_policy='recompute' in "
                "kv_transfer_config, or a failed cache load fails its request (%s)",
                exc,
            )
        else:
            log.info("kvstore connector: kv_load_failure_policy set to 'recompute'")

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped save is only a future miss."""
        return False

    # --- worker side ------------------------------------------------------------------------

    def _worker_side(self) -> WorkerSide:
        assert self._worker is not None, "bug: a worker hook called on the scheduler connector"
        return self._worker

    def _meta(self) -> KVStoreConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Recognise vLLM's paged KV tensors and map the node's pool."""
        self._worker_side().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's loads (asynchronous: vLLM waits for `get_finished`)."""
        if self.has_connector_metadata():
            self._worker_side().start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish before their request is scheduled: nothing to wait for."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Saves are done whole in `wait_for_save`, after the forward."""

    def wait_for_save(self) -> None:
        """Copy out this step's newly completed full blocks; stored in the background."""
        if self.has_connector_metadata():
            self._worker_side().save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose last blocks were copied out (vLLM may free them now),
        and requests whose loads finished (done or failed)."""
        if self._worker is None:
            return None, None
        return (self._worker.take_sent() or None), (self._worker.take_finished() or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`'s requests, and those whose load failed when the model has
        several KV cache groups (vLLM then recomputes the whole request: it cannot
        map block ids of several groups back to requests)."""
        results = super().get_transfer_results(finished_req_ids)
        if self._worker is not None:
            results.failed_recving = self._worker.take_failed_requests()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids of the loads `get_finished` reported failed: vLLM recomputes them
        (one KV cache group; with several, `get_transfer_results` names the requests)."""
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Loads and saves finished this step (pins to release, saved blocks to count)."""
        return self._worker.take_report() if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This worker's load counts since the last step (vLLM's ``/metrics``)."""
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """The counts of `get_kv_connector_stats`, rebuilt in vLLM's logger process."""
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVStorePromMetrics:
        """The connector's counters on vLLM's ``/metrics`` (`stats`)."""
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Release pins, unmap the pool, close the client."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # --- scheduler side -----------------------------------------------------------------------

    def _scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "bug: a scheduler hook called on a worker connector"
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens cached on the node beyond vLLM's local hit, loaded asynchronously.

        None while the lookup is in flight: vLLM asks again on a later step.
        """
        tokens = self._scheduler_side().num_new_matched_tokens(request, num_computed_tokens)
        return tokens, bool(tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the accepted hit, or release what vLLM did not take."""
        block_ids = blocks.get_block_ids() if num_external_tokens > 0 else ()
        self._scheduler_side().after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads and saves."""
        return self._scheduler_side().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Act on the workers' report (pins of finished loads, confirmed saves)."""
        self._scheduler_side().on_worker_output(connector_output)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Drop what the request still pins. vLLM frees its blocks (every group's) at once,
        unless full blocks are still to be copied out (True: freed when `get_finished`
        reports it)."""
        return self._scheduler_side().request_finished(request, block_ids), None

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished_all_groups` of a one-group model (vLLM calls that one)."""
        return self.request_finished_all_groups(request, (block_ids,))
