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
- ``wait_for_save`` (after the forward): each planned save copies its new
  full blocks out of vLLM's cache on the forward's thread (so vLLM may reuse
  them at once); the save thread stores them (Reserve, copy, Commit).
  Bytes waiting for the node are bounded by ``max_pending_save_bytes``;
  beyond it a save is dropped (a future miss).
- Every finished load and save is reported to the scheduler side
  (`KVStoreWorkerReport`), which releases pins and advances saves on it.
- **Nothing derived from a failed load is saved**: its blocks stay tainted
  until the scheduler has seen the failure
  (`KVStoreConnectorMetadata.failures_seen`); a save that touches one is
  refused and its request is never saved again.

The idle-step copy's timings: benchmarks/README.md, `bench_vllm.py`.
"""

from __future__ import annotations

import enum
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
    gather_blocks,
    paged_layer,
    scatter_blocks,
    scatter_runs,
    stored_shape,
)
from kvstore.integrations.vllm.stats import KVStoreConnectorStats
from kvstore.layout import KVLayout
from kvstore.pool import HostMapping, PoolMapping
from kvstore.pool.views import torch_dtype
from kvstore.types import SlotId

log = logging.getLogger(__name__)


class LoadFailed(Exception):
    """A load that must not be used (the reason is the message)."""


class _Unstaged(Exception):
    """A save needs a block that was not copied out (the node lost it since the lookup)."""


class SaveEnd(enum.Enum):
    """How a save ended, as the scheduler side is told (`KVStoreWorkerReport`)."""

    SAVED = "saved"
    """Every block is on the node: reported with the count."""
    RETRY = "retry"
    """Not (all) saved: planned again from the blocks confirmed so far."""
    RESTAGE = "restage"
    """The node lost a block before the copied-out ones: planned again from block 0."""
    NOT_STAGED = "not_staged"
    """Copying out failed before the save thread had it (the error goes to vLLM): nothing
    to report."""


class _NotAllStored(Exception):
    """The node did not take every block of a save (no room, or another writer's)."""


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Nothing is contacted here; `register_kv_caches` starts connecting.

        Args:
            rank: this worker's tensor-parallel rank: it copies only the loads and
                saves of its rank (its own namespace, holding its share of the heads).
            order: how the namespace's blocks are ordered in the pool (`paged`).
        """
        self.link = link
        self.rank = rank
        self.order = order
        self.layout = layout
        self.layer_names = list(layer_names)
        self.fail_loads = fail_loads
        self.max_pending_save_bytes = max_pending_save_bytes
        self._clock = clock
        self.layers: list[PagedLayer] = []
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")
        self._lock = threading.Lock()
        """Guards what the threads hand back: `_done_loads`, `_report`, `_pending_bytes`."""
        self._sent: set[str] = set()
        """Finished requests whose last blocks were copied out (or skipped): vLLM may
        free their blocks (`take_sent`)."""
        self._done_loads: list[tuple[str, tuple[int, ...]]] = []
        """(request, its failed block ids: empty when the load worked), as finished."""
        self._load_errors: set[int] = set()
        self._report = KVStoreWorkerReport()
        self._failure_seq = 0
        self._tainted: dict[int, int] = {}
        """vLLM block id -> number of the load failure that left it unloaded."""
        self._pending_bytes = 0
        self._closed = False
        """After `shutdown`: loads fail at once (vLLM recomputes), saves are skipped."""
        self.loaded_blocks = 0
        """Blocks copied in from the node so far, proven by their stamps (for logs and tests)."""
        self._stats = KVStoreConnectorStats()
        """Counts since `take_stats` (vLLM's ``/metrics``)."""
        self.saved_blocks = 0
        """Blocks this worker committed to the node so far."""

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Recognise the paged tensors (in the KV group's layer order); start connecting."""
        missing = [name for name in self.layer_names if name not in kv_caches]
        if missing:
            raise KeyError(f"vLLM registered no KV cache for layers {missing}")
        self.layers = [paged_layer(kv_caches[name], self.layout) for name in self.layer_names]
        self.link.namespace()  # registers (and maps the pool) in the background

    # --- loads -------------------------------------------------------------------------

    def start_load(self, meta: KVStoreConnectorMetadata) -> None:
        """Hand this step's loads to the load thread (vLLM waits for `take_finished`)."""
        self._forget_seen_failures(meta.failures_seen)
        for load in meta.loads:
            if load.rank != self.rank:
                continue
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

    def _mapped_for(self, load: LoadSpec) -> bool:
        """Whether ``load`` can be copied with no call to the node (never waits): the
        namespace is registered and its mapping already covers the lookup's arenas.
        Otherwise the load thread waits for the node, never the engine's step."""
        ns = self.link.namespace()
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
        with self._lock:
            self._done_loads.append((load.request_id, failed))
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
        ns = self.link.wait_namespace(self.link.config.connect_timeout)
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
        if isinstance(mapping, HostMapping) and self.layers and not self.layers[0].tensor.is_cuda:
            scatter_runs(self.layers, self._runs(mapping, load))
        else:
            views = [
                as_canonical(mapping.torch_view(SlotId(slot), self.layout), self.layout, self.order)
                for slot in load.slots
            ]
            scatter_blocks(self.layers, load.block_ids, views)
        if self.layers and self.layers[0].tensor.is_cuda:
            torch.cuda.synchronize(self.layers[0].tensor.device)
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

    def _runs(self, mapping: HostMapping, load: LoadSpec) -> list[tuple[int, torch.Tensor]]:
        """The load as runs: adjacent slots of one arena going to adjacent vLLM blocks, each
        one canonical-shaped view of the mapped pool (nothing copied here)."""
        spa, block_bytes = mapping.descriptor.slots_per_arena, mapping.descriptor.block_bytes
        slots, block_ids = load.slots, load.block_ids
        dtype = torch_dtype(self.layout.dtype)
        shape = stored_shape(self.layout, self.order)
        runs = []
        for a, b in itertools.pairwise(slot_runs(slots, block_ids, spa)):
            offset = slots[a] % spa * block_bytes
            arena = mapping.arena_buffer(slots[a] // spa)
            flat = torch.frombuffer(arena[offset : offset + (b - a) * block_bytes], dtype=dtype)
            runs.append(
                (block_ids[a], as_canonical(flat.view(b - a, *shape), self.layout, self.order))
            )
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
                self._load_errors.update(failed)
                self._report.failed_loads.add((req_id, self.rank))
                self._report.failed_blocks.update(failed)
                for block_id in failed:
                    self._tainted[block_id] = self._failure_seq
        return {req_id for req_id, _ in done}

    def take_load_errors(self) -> set[int]:
        """vLLM block ids of the loads `take_finished` reported failed."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _forget_seen_failures(self, seen: int) -> None:
        if self._tainted:
            self._tainted = {b: seq for b, seq in self._tainted.items() if seq > seen}

    # --- saves -------------------------------------------------------------------------

    def save(self, meta: KVStoreConnectorMetadata) -> None:
        """Copy out this step's new full blocks and hand them to the save thread."""
        self._forget_seen_failures(meta.failures_seen)
        for save in meta.saves:
            if save.rank != self.rank:
                continue
            try:
                if not self._closed:
                    self._save(save)
            finally:
                if save.frees_blocks:  # copied out or not, vLLM must get its blocks back
                    self._sent.add(save.request_id)

    def _save(self, save: SaveSpec) -> None:
        if self._tainted and not self._tainted.keys().isdisjoint(save.block_ids):
            log.warning(
                "kvstore: request %s is not saved: its blocks include a failed load's",
                save.request_id,
            )
            with self._lock:
                self._report.poisoned.add(save.request_id)
            return
        self._stage(save)

    def take_sent(self) -> set[str]:
        """Finished requests whose blocks vLLM may free now (their last save was copied
        out, or skipped), since the last call."""
        sent, self._sent = self._sent, set()
        return sent

    def _stage(self, save: SaveSpec) -> None:
        new_ids = save.block_ids[save.first_new :]
        nbytes = len(new_ids) * self.layout.block_bytes
        with self._lock:
            if self.link.down or self._pending_bytes + nbytes > self.max_pending_save_bytes:
                self._report.unsaved[save.request_id] = False
                return
            self._pending_bytes += nbytes
        try:
            staged = (
                gather_blocks(self.layers, new_ids, self.layout, self.order) if new_ids else None
            )
            ready: Any = None
            if staged is not None and staged.is_cuda:
                ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                ready.record()
        except BaseException:
            self._saved(save, nbytes, SaveEnd.NOT_STAGED)
            raise
        self._saver.submit(self._run_save, save, staged, ready, nbytes)

    def _run_save(
        self, save: SaveSpec, staged: torch.Tensor | None, ready: Any, nbytes: int
    ) -> None:
        end, blocks = SaveEnd.RETRY, 0
        try:
            if ready is not None:
                ready.synchronize()  # the copy-out, queued on the forward's stream
            blocks = self._store(save, staged)
            end = SaveEnd.SAVED
            self.link.succeeded()
        except _Unstaged:
            end = SaveEnd.RESTAGE
        except _NotAllStored as exc:
            log.debug("kvstore: request %s not all saved: %s", save.request_id, exc)
        except KVStoreError as exc:
            self.link.failed("store on", exc)
        except Exception:
            log.exception("kvstore: saving request %s failed", save.request_id)
        finally:
            self._saved(save, nbytes, end, blocks)

    def _store(self, save: SaveSpec, staged: torch.Tensor | None) -> int:
        ns = self.link.wait_namespace(self.link.config.connect_timeout)
        client = self.link.client
        if ns is None or client is None:
            raise KVStoreError("the node is unreachable")
        first = save.first_new

        def block(index: int) -> torch.Tensor:
            if index < first or staged is None:
                raise _Unstaged(f"block {index} was not copied out")
            return staged[index - first]

        result = client.store(
            ns, hashes=list(save.hashes), blocks=block, timeout=self.link.config.store_timeout
        )
        self.saved_blocks += result.committed
        if result.no_room or result.in_flight:
            # Not every block is on the node (no room, or another writer's still in
            # flight): say so, and the scheduler plans them again.
            raise _NotAllStored(f"{result.no_room} had no room, {result.in_flight} in flight")
        return len(save.hashes)

    def _saved(self, save: SaveSpec, nbytes: int, end: SaveEnd, blocks: int = 0) -> None:
        """Record a save's end (``blocks``: leading blocks now on the node, when SAVED)."""
        with self._lock:
            self._pending_bytes -= nbytes
            if end is SaveEnd.SAVED:
                self._report.saved[(save.request_id, self.rank)] = blocks
                self._report.unsaved.pop(save.request_id, None)
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
        if not (report.loaded or report.saved or report.unsaved or report.poisoned):
            return None
        return report

    def shutdown(self) -> None:
        """Stop the threads (queued saves are dropped), unmap the pool, close the client.

        Idempotent; hooks called afterwards do nothing harmful (loads fail, saves skip).
        """
        if self._closed:
            return
        self._closed = True
        self._saver.shutdown(wait=False, cancel_futures=True)
        # Queued loads are not run: vLLM is stopping, and the scheduler's lease may
        # be ending. A copy under way fails at its end (`_closed`).
        self._loader.shutdown(wait=True, cancel_futures=True)
        self.link.close()
