"""The worker half of the connector: copies between the node's pool and vLLM's cache.

- ``register_kv_caches``: the engine's per-layer paged tensors are recognised
  (`kvstore.integrations.vllm.paged`) and the node's pool is mapped once
  (a host pool file, or a CUDA pool's IPC handles on a GPU).
- ``start_load_kv`` (before the forward): each planned load copies its pinned
  pool slots into the request's vLLM blocks, one batched scatter per layer.
  A load that cannot be done (node gone, pool remapped at another epoch,
  pins lost, a copy error) reports its vLLM block ids through
  ``get_block_ids_with_load_errors``; vLLM then recomputes those tokens.
- ``wait_for_save`` (after the forward): each planned save gathers the new
  full blocks and stores them (Reserve, copy into the pool, Commit; the
  client SDK aborts whatever it reserved if anything fails). A failed save
  costs only future hits.
- Every load it finished (done or failed) is reported back to the scheduler
  side, which then releases the pins.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from kvstore.client import Namespace
from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.link import NodeLink
from kvstore.integrations.vllm.metadata import (
    KVStoreConnectorMetadata,
    KVStoreWorkerReport,
    LoadSpec,
    SaveSpec,
)
from kvstore.integrations.vllm.paged import (
    PagedLayer,
    gather_blocks,
    paged_layer,
    scatter_blocks,
)
from kvstore.layout import KVLayout
from kvstore.types import SlotId

log = logging.getLogger(__name__)


class WorkerSide:
    """Worker-side state of the connector (one per worker process)."""

    def __init__(
        self, link: NodeLink, layout: KVLayout, layer_names: Sequence[str], *, fail_loads: bool
    ) -> None:
        """Nothing is contacted here; `register_kv_caches` maps the pool."""
        self.link = link
        self.layout = layout
        self.layer_names = list(layer_names)
        self.fail_loads = fail_loads
        self.layers: list[PagedLayer] = []
        self._load_errors: set[int] = set()
        self._loaded: set[str] = set()
        self.loaded_blocks = 0
        """Blocks copied in from the node so far (for logs and tests)."""
        self.saved_blocks = 0
        """Blocks this worker committed to the node so far."""

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Recognise the paged tensors (in the KV group's layer order) and map the pool."""
        missing = [name for name in self.layer_names if name not in kv_caches]
        if missing:
            raise KeyError(f"vLLM registered no KV cache for layers {missing}")
        self.layers = [paged_layer(kv_caches[name], self.layout) for name in self.layer_names]
        self.link.namespace()  # map the pool now; when the node is down, on first use

    def start_load(self, meta: KVStoreConnectorMetadata) -> None:
        """Run every load of the step (synchronously: this step's forward reads them)."""
        for load in meta.loads:
            self._loaded.add(load.request_id)
            if not load.block_ids:
                continue
            try:
                self._load(load)
            except Exception as exc:  # any failure: vLLM recomputes these blocks
                self._load_errors.update(load.block_ids)
                log.warning(
                    "kvstore: loading %d blocks of request %s failed (%s: %s); vLLM recomputes "
                    "them",
                    len(load.block_ids),
                    load.request_id,
                    type(exc).__name__,
                    exc,
                )

    def _load(self, load: LoadSpec) -> None:
        if self.fail_loads:
            raise RuntimeError("fail_loads is set (testing)")
        if not load.valid:
            raise RuntimeError("the scheduler lost the pins (lease lost) before the load")
        ns = self.link.namespace()
        if ns is None:
            raise RuntimeError("the node is unreachable")
        mapping = ns.mapping
        if mapping is None or mapping.closed or ns.epoch != load.epoch:
            raise RuntimeError(
                f"the pool mapping is at epoch {ns.epoch}, the lookup at {load.epoch}"
            )
        if load.pool_version > mapping.descriptor.version:
            # The pool grew (or was dropped and made again) since this worker
            # mapped it: follow it before reading, never through old arenas.
            client = self.link.client
            if client is None:
                raise RuntimeError("the node is unreachable")
            client.follow_pool(ns, load.pool_version, timeout=self.link.config.connect_timeout)
            mapping = ns.mapping
            if mapping is None or mapping.closed or mapping.descriptor.version < load.pool_version:
                raise RuntimeError("the pool mapping could not follow the node's arenas")
        views = [mapping.torch_view(SlotId(slot), self.layout) for slot in load.slots]
        scatter_blocks(self.layers, load.block_ids, views)
        self.loaded_blocks += len(load.block_ids)

    def save(self, meta: KVStoreConnectorMetadata) -> None:
        """Store every save of the step (after the forward wrote the blocks)."""
        if not meta.saves:
            return
        ns = self.link.namespace()
        if ns is None:
            return
        for save in meta.saves:
            try:
                self._save(ns, save)
            except KVStoreError as exc:
                self.link.failed("store on", exc)
                return

    def _save(self, ns: Namespace, save: SaveSpec) -> None:
        client = self.link.client
        assert client is not None, "bug: a namespace without a client"
        first = save.first_new
        likely = gather_blocks(self.layers, save.block_ids[first:], self.layout)

        def block(index: int) -> torch.Tensor:
            # Usually only the new blocks are written; an older one (evicted since
            # the lookup) is gathered on its own.
            if index >= first:
                return likely[index - first]
            return gather_blocks(self.layers, [save.block_ids[index]], self.layout)[0]

        result = client.store(
            ns, hashes=list(save.hashes), blocks=block, timeout=self.link.config.store_timeout
        )
        self.saved_blocks += result.committed

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> KVStoreWorkerReport | None:
        """Requests whose loads finished since the last call, for the scheduler side."""
        if not self._loaded:
            return None
        report = KVStoreWorkerReport(self._loaded)
        self._loaded = set()
        return report

    def shutdown(self) -> None:
        """Unmap the pool and close the client."""
        self.link.close()
