"""The worker half of the connector: copies between the node's pool and vLLM's cache.

Nothing here makes vLLM's forward wait on the node:

- ``register_kv_caches``: vLLM's paged tensors are recognised
  (`kvstore.integrations.vllm.paged`); the namespace is registered (the
  node's pool mapped) in the background.
- ``start_load_kv``: each planned load is copied from the pinned pool slots
  into the request's vLLM blocks by the load thread, or in ``start_load_kv``
  itself in a step that runs no forward (the metadata's ``idle``) when the
  pool is mapped as the lookup saw it. vLLM holds the request
  (``WAITING_FOR_REMOTE_KVS``) until ``get_finished`` reports the load. A
  copy counts only if it finished while the pins were surely held
  (`LoadSpec.pins_until`, on this host's monotonic clock) and the slots'
  stamps did not move; otherwise (a stalled engine, a lost lease, another
  pool epoch, any copy error) the load fails, its blocks are reported by
  ``get_block_ids_with_load_errors`` and vLLM recomputes them.
- ``wait_for_save`` (after the forward): each planned save of this rank's
  units copies its new full blocks out of vLLM's cache (`saves.SaveStager`:
  within ``max_pending_save_bytes``, in parts when larger) and the save
  thread stores them (Reserve, copy, Commit).
- A worker copies the units (`units`: a KV cache group's namespace) that
  hold its rank's KV: its own share of each group, and MLA's, which every
  rank loads and rank 0 saves. A request's load is reported once every unit
  this rank copies for it is done.
- Every finished load and save is reported to the scheduler side
  (`KVStoreWorkerReport`), which releases pins and advances saves on it.
- **Nothing derived from a failed load is saved**: its blocks stay tainted
  until the scheduler has seen the failure
  (`KVStoreConnectorMetadata.failures_seen`); a save that touches one is
  refused and its request is never saved again.

The idle-step copy's timings: benchmarks/README.md, `bench_vllm.py`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvstore.checksum import mismatches
from kvstore.client.blocks import slot_runs
from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.metadata import (
    KVStoreConnectorMetadata,
    KVStoreWorkerReport,
    LoadSpec,
    SaveSpec,
)
from kvstore.integrations.vllm.node_link import NodeLink
from kvstore.integrations.vllm.paged import (
    BlockOrder,
    PagedLayer,
    as_canonical,
    paged_layer,
    scatter_blocks,
    scatter_runs,
    stored_shape,
)
from kvstore.integrations.vllm.saves import SaveEnd, SaveStager
from kvstore.integrations.vllm.stats import KVStoreConnectorStats
from kvstore.integrations.vllm.units import UnitCopy, unit_namespace
from kvstore.layout import KVLayout
from kvstore.pool import HostMapping, PoolMapping
from kvstore.pool.views import torch_dtype
from kvstore.types import SlotId

log = logging.getLogger(__name__)


class LoadFailed(Exception):
    """A load that must not be used (the reason is the message)."""


class WorkerSide:
    """Worker-side state of the connector (one per worker process)."""

    def __init__(
        self,
        link: NodeLink,
        layout: KVLayout,
        layer_names: Sequence[str],
        *,
        fail_loads: bool,
        max_pending_save_bytes: int,
        rank: int = 0,
        order: BlockOrder = "canonical",
        units: Sequence[UnitCopy] | None = None,
        request_level_errors: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Nothing is contacted here; `register_kv_caches` starts connecting.

        Args:
            rank: this worker's tensor-parallel rank: it copies only the loads and
                saves of its units (`units`).
            order: how the namespace's blocks are ordered in the pool (`paged`).
            units: what this rank copies, one per namespace of its link
                (`unit_copies`); by default one unit, ``rank``, of ``layout`` and
                ``layer_names``.
            request_level_errors: report failed loads by request
                (`take_failed_requests`), not by block id: vLLM refuses block-level
                errors for models of several KV cache groups.
        """
        self.link = link
        self.rank = rank
        self.order = order
        self.units = (
            list(units) if units is not None else [UnitCopy(rank, 0, layout, list(layer_names))]
        )
        self._by_unit = {copy.unit: copy for copy in self.units}
        self.request_level_errors = request_level_errors
        self.fail_loads = fail_loads
        self.max_pending_save_bytes = max_pending_save_bytes
        self._clock = clock
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
        self._saves = SaveStager(link, order, max_pending_save_bytes, self._save_ended)
        self._lock = threading.Lock()
        """Guards what the threads hand back: `_done_loads`, `_report`, `_stats`."""
        self._loading: dict[str, tuple[int, tuple[int, ...]]] = {}
        """Per request: its loads still copying here, and the failed block ids so far."""
        self._failed_requests: set[str] = set()
        """Requests whose load failed, for `take_failed_requests`."""
        self._done_loads: list[tuple[str, tuple[int, ...]]] = []
        """(request, its failed block ids: empty when the load worked), as finished."""
        self._load_errors: set[int] = set()
        self._report = KVStoreWorkerReport()
        self._failure_seq = 0
        self._tainted: dict[int, int] = {}
        """vLLM block id -> number of the load failure that left it unloaded."""
        self._closed = False
        """After `shutdown`: loads fail at once (vLLM recomputes), saves are skipped."""
        self.loaded_blocks = 0
        """Blocks copied in from the node so far, proven by their stamps (for logs and tests)."""
        self._stats = KVStoreConnectorStats()
        """Counts since `take_stats` (vLLM's ``/metrics``)."""

    @property
    def layers(self) -> list[PagedLayer]:
        """The paged layers of the first unit (the only one of a one-group model)."""
        return self.units[0].layers

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Recognise the paged tensors (each unit's, in its layer order); start connecting."""
        for copy in self.units:
            missing = [name for name in copy.layer_names if name not in kv_caches]
            if missing:
                raise KeyError(f"vLLM registered no KV cache for layers {missing}")
            copy.layers = [paged_layer(kv_caches[name], copy.layout) for name in copy.layer_names]
        self.link.namespace()  # registers (and maps the pool) in the background

    @property
    def saved_blocks(self) -> int:
        """Blocks this worker committed to the node so far."""
        return self._saves.saved_blocks

    # --- loads -------------------------------------------------------------------------

    def start_load(self, meta: KVStoreConnectorMetadata) -> None:
        """Hand this step's loads to the load thread (vLLM waits for `take_finished`)."""
        self._forget_seen_failures(meta.failures_seen)
        mine = [load for load in meta.loads if self._copies_in(load)]
        with self._lock:
            for load in mine:
                count, failed = self._loading.get(load.request_id, (0, ()))
                self._loading[load.request_id] = (count + 1, failed)
        for load in mine:
            if self._closed:  # vLLM may still drain requests after a stop signal
                self._load_done(load, load.block_ids)
                continue
            if meta.idle and self._mapped_for(load):
                self._run_load(load)  # no forward waits on this step: copy now
            else:
                try:
                    self._loader.submit(self._run_load, load)
                except RuntimeError:  # shut down meanwhile (another thread)
                    self._load_done(load, load.block_ids)

    def _copies_in(self, load: LoadSpec) -> bool:
        copy = self._by_unit.get(load.unit)
        return copy is not None and copy.loads

    def _mapped_for(self, load: LoadSpec) -> bool:
        """Whether ``load`` can be copied with no call to the node (never waits): the
        namespace is registered and its mapping already covers the lookup's arenas.
        Otherwise the load thread waits for the node, never the engine's step."""
        ns = unit_namespace(self.link, self._by_unit[load.unit])
        mapping = ns.mapping if ns is not None else None
        return (
            mapping is not None
            and not mapping.closed
            and load.pool_version <= mapping.descriptor.version
        )

    def _run_load(self, load: LoadSpec) -> None:
        failed: tuple[int, ...] = ()
        try:
            failed = self._load(load)
        except Exception as exc:  # any failure: vLLM recomputes these blocks
            failed = load.block_ids
            log.warning(
                "kvstore: loading %d blocks of request %s failed (%s: %s); vLLM recomputes them",
                len(load.block_ids),
                load.request_id,
                type(exc).__name__,
                exc,
            )
        self._load_done(load, failed)

    def _load_done(self, load: LoadSpec, failed: tuple[int, ...]) -> None:
        """One load finished; the request's report waits for its last load here."""
        with self._lock:
            count, before = self._loading.pop(load.request_id, (1, ()))
            if count > 1:
                self._loading[load.request_id] = (count - 1, before + failed)
            else:
                self._done_loads.append((load.request_id, before + failed))
            self._stats.add("loaded_blocks", len(load.block_ids) - len(failed))
            self._stats.add("load_error_blocks", len(failed))
            self.loaded_blocks += len(load.block_ids) - len(failed)

    def _load(self, load: LoadSpec) -> tuple[int, ...]:
        """Copy one load; the vLLM block ids whose copy is not proven (empty: all are)."""
        if not load.block_ids:
            return ()
        if self._closed:
            raise LoadFailed("the connector is shutting down")
        if self.fail_loads:
            raise LoadFailed("fail_loads is set (testing)")
        if self._clock() >= load.pins_until:
            raise LoadFailed("the pins are not surely held (lease lost, or the engine stalled)")
        copy = self._by_unit[load.unit]
        ns = unit_namespace(self.link, copy, self.link.config.connect_timeout)
        if ns is None:
            raise LoadFailed("the node is unreachable")
        if ns.epoch != load.epoch and self.link.client is not None:
            # The scheduler looked up on a node that restarted since this process mapped its
            # pool (a worker that only loads makes no call that would notice): remap first.
            try:
                self.link.client.follow_epoch(
                    ns, load.epoch, timeout=self.link.config.lookup_timeout
                )
            except KVStoreError as exc:
                raise LoadFailed(f"the pool could not be mapped again ({exc})") from exc
        mapping = ns.mapping
        if mapping is None or mapping.closed or ns.epoch != load.epoch:
            raise LoadFailed(f"the pool mapping is at epoch {ns.epoch}, the lookup at {load.epoch}")
        if load.pool_version > mapping.descriptor.version:
            # The pool grew (or was dropped and made again) since this worker
            # mapped it: follow it before reading, never through old arenas.
            client = self.link.client
            if client is None:
                raise LoadFailed("the node is unreachable")
            client.follow_pool(ns, load.pool_version, timeout=self.link.config.lookup_timeout)
            mapping = ns.mapping
            if mapping is None or mapping.closed or mapping.descriptor.version < load.pool_version:
                raise LoadFailed("the pool mapping could not follow the node's arenas")
        slots = np.asarray(load.slots, dtype=np.uint64)
        expected = np.asarray(load.stamps, dtype=np.uint64).reshape(-1, 2)
        if len(expected) != len(slots):
            raise LoadFailed(f"{len(expected)} stamps for {len(slots)} slots")
        if stale := int(self._moved(mapping, slots, expected).sum()):
            with self._lock:
                self._stats.add("load_moved_blocks", stale)
            raise LoadFailed(f"{stale} slots no longer hold the blocks the lookup found")
        layers, layout = copy.layers, copy.layout
        if isinstance(mapping, HostMapping) and layers and not layers[0].tensor.is_cuda:
            scatter_runs(layers, self._runs(mapping, load, layout))
        else:
            views = [
                as_canonical(mapping.torch_view(SlotId(slot), layout), layout, self.order)
                for slot in load.slots
            ]
            scatter_blocks(layers, load.block_ids, views)
        if layers and layers[0].tensor.is_cuda:
            torch.cuda.synchronize(layers[0].tensor.device)
        # The fence: every byte above was read before this instant. The proof: each
        # slot's stamp is still the lookup's, so no writer was handed the slot before
        # the copy landed (a seqlock's second read); a moved block is a load error.
        moved = self._moved(mapping, slots, expected)
        bad = moved | self._corrupt(mapping, load) if ns.verify_loads else moved
        if self._closed:
            raise LoadFailed("the connector shut down during the copy")
        if self._clock() >= load.pins_until:
            raise LoadFailed("the copy outlasted the pins (lease lost, or the engine stalled)")
        if n_moved := int(moved.sum()):
            with self._lock:
                self._stats.add("load_moved_blocks", n_moved)
            log.warning(
                "kvstore: %d of %d blocks of request %s were overwritten during their copy "
                "(slot stamps moved); vLLM recomputes them",
                n_moved,
                len(load.block_ids),
                load.request_id,
            )
        return tuple(b for b, wrong in zip(load.block_ids, bad.tolist(), strict=True) if wrong)

    def _corrupt(self, mapping: PoolMapping, load: LoadSpec) -> npt.NDArray[np.bool_]:
        """Per slot: whether its bytes differ from their writer's checksum (full
        verification; host pools, where the bytes are readable here)."""
        bad = np.zeros(len(load.slots), dtype=bool)
        if not load.checksums or not isinstance(mapping, HostMapping):
            return bad  # CUDA writers send no checksum yet (docs/cuda.md)
        buffers = [mapping.buffer(SlotId(slot)) for slot in load.slots]
        wrong = mismatches(buffers, load.checksums)
        if wrong:
            bad[wrong] = True
            with self._lock:
                self._stats.add("load_checksum_failed_blocks", len(wrong))
                # Reported with the release: the node drops them (no recompute forever).
                self._report.corrupt[(load.request_id, load.unit)] = tuple(
                    load.slots[i] for i in wrong
                )
            log.warning(
                "kvstore: %d blocks of request %s do not match their writer's checksum "
                "(tier local, first slot %d); vLLM recomputes them",
                len(wrong),
                load.request_id,
                load.slots[wrong[0]],
            )
        return bad

    @staticmethod
    def _moved(mapping: PoolMapping, slots: npt.NDArray[np.uint64], expected: Any) -> Any:
        """Per slot: whether its stamp is no longer the lookup's (`kvstore.pool.stamps`)."""
        return (mapping.read_stamps(slots) != expected).any(axis=1)

    def _runs(
        self, mapping: HostMapping, load: LoadSpec, layout: KVLayout
    ) -> list[tuple[int, torch.Tensor]]:
        """The load as runs: adjacent slots of one arena going to adjacent vLLM blocks, each
        one canonical-shaped view of the mapped pool (nothing copied here)."""
        spa, block_bytes = mapping.descriptor.slots_per_arena, mapping.descriptor.block_bytes
        slots, block_ids = load.slots, load.block_ids
        dtype = torch_dtype(layout.dtype)
        shape = stored_shape(layout, self.order)
        runs = []
        for a, b in itertools.pairwise(slot_runs(slots, block_ids, spa)):
            offset = slots[a] % spa * block_bytes
            arena = mapping.arena_buffer(slots[a] // spa)
            flat = torch.frombuffer(arena[offset : offset + (b - a) * block_bytes], dtype=dtype)
            runs.append((block_ids[a], as_canonical(flat.view(b - a, *shape), layout, self.order)))
        return runs

    def take_finished(self) -> set[str]:
        """Requests whose loads finished (done or failed) since the last call."""
        with self._lock:
            done, self._done_loads = self._done_loads, []
            for req_id, failed in done:
                self._report.loaded.add((req_id, self.rank))
                if not failed:
                    continue
                self._failure_seq += 1
                if self.request_level_errors:
                    self._failed_requests.add(req_id)
                else:
                    self._load_errors.update(failed)
                self._report.failed_loads.add((req_id, self.rank))
                self._report.failed_blocks.update(failed)
                for block_id in failed:
                    self._tainted[block_id] = self._failure_seq
        return {req_id for req_id, _ in done}

    def take_load_errors(self) -> set[int]:
        """vLLM block ids of the loads `take_finished` reported failed (by block)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_requests(self) -> set[str]:
        """Requests whose load `take_finished` reported failed (by request: models of
        several KV cache groups, whose block ids vLLM cannot map back to requests)."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def _forget_seen_failures(self, seen: int) -> None:
        if self._tainted:
            self._tainted = {b: seq for b, seq in self._tainted.items() if seq > seen}

    # --- saves -------------------------------------------------------------------------

    def save(self, meta: KVStoreConnectorMetadata) -> None:
        """Copy out this step's new full blocks and hand them to the save thread."""
        self._forget_seen_failures(meta.failures_seen)
        for save in meta.saves:
            copy = self._by_unit.get(save.unit)
            if copy is None or not copy.saves:
                continue
            handed_over = False
            try:
                if not self._closed:
                    handed_over = self._save(save, copy)
            finally:
                # Copied out or not, vLLM must get its blocks back; a save handed to
                # the save thread whole reports them itself once it is done.
                if save.frees_blocks and not handed_over:
                    self._saves.mark_sent(save.request_id)

    def _save(self, save: SaveSpec, copy: UnitCopy) -> bool:
        """Stage ``save``; True when the save thread took it whole (`SaveStager`)."""
        if self._tainted and not self._tainted.keys().isdisjoint(save.block_ids):
            log.warning(
                "kvstore: request %s is not saved: its blocks include a failed load's",
                save.request_id,
            )
            with self._lock:
                self._report.poisoned.add(save.request_id)
            return False
        return self._saves.stage(save, copy)

    def take_sent(self) -> set[str]:
        """Finished requests whose blocks vLLM may free now (their last save was copied
        out, or skipped), since the last call."""
        return self._saves.take_sent()

    def _save_ended(self, save: SaveSpec, end: SaveEnd, blocks: int) -> None:
        """Report a save's end to the scheduler side (``blocks``: leading blocks now on
        the node, when SAVED or PARTIAL)."""
        with self._lock:
            key = (save.request_id, save.unit)
            if end is SaveEnd.SAVED:
                self._report.saved[key] = blocks
                self._report.unsaved.pop(save.request_id, None)
            elif end is SaveEnd.PARTIAL:
                self._report.saved[key] = blocks
                self._report.unsaved[save.request_id] = False
            elif end is not SaveEnd.NOT_STAGED:
                self._report.unsaved[save.request_id] = end is SaveEnd.RESTAGE

    # --- reports and life cycle --------------------------------------------------------

    def take_stats(self) -> KVStoreConnectorStats | None:
        """Load counts since the last call (None: nothing counted)."""
        with self._lock:
            stats, self._stats = self._stats, KVStoreConnectorStats()
        return None if stats.is_empty() else stats

    def take_report(self) -> KVStoreWorkerReport | None:
        """What finished since the last call, for the scheduler side (None: nothing)."""
        with self._lock:
            report, self._report = self._report, KVStoreWorkerReport()
            report.failure_seq = self._failure_seq
        # A failed load is always among `loaded`: nothing else can be pending.
        if not (
            report.loaded or report.saved or report.unsaved or report.poisoned or report.corrupt
        ):
            return None
        return report

    def shutdown(self) -> None:
        """Stop the threads (queued saves are dropped), unmap the pool, close the client.

        Idempotent; hooks called afterwards do nothing harmful (loads fail, saves skip).
        """
        if self._closed:
            return
        self._closed = True
        self._saves.shutdown()
        # Queued loads are not run: vLLM is stopping, and the scheduler's lease may
        # be ending. A copy under way fails at its end (`_closed`).
        self._loader.shutdown(wait=True, cancel_futures=True)
        self.link.close()
