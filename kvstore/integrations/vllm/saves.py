"""A worker's saves: copied out of vLLM's cache within a byte budget, stored in a thread.

`SaveStager.stage` runs on the forward's thread (``wait_for_save``): it copies
a save's new blocks out of vLLM's paged cache, so vLLM may reuse them at
once, and hands them to the save thread, which stores them on the node
(Reserve, copy, Commit). Bytes copied out and not yet stored are bounded by
``max_pending_save_bytes``; a save larger than the room left is staged in
parts, so every save lands whatever its size:

- a running request's first part now, reported saved so far (`SaveEnd.PARTIAL`):
  the scheduler plans the rest again next step, its blocks still vLLM's;
- a finished request's, whose blocks vLLM keeps until it is reported sent
  (``finished_sending``), part by part in the save thread, each part what
  the budget has room for (one block at least: the saves holding the rest
  are queued behind it on that thread, so it never waits for them); it is
  reported sent once its last part is stored (or failed).

Each save's end goes to the worker (`SaveEnd`), which reports it to the
scheduler side.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.metadata import SaveSpec
from kvstore.integrations.vllm.node_link import NodeLink
from kvstore.integrations.vllm.paged import BlockOrder, gather_blocks
from kvstore.integrations.vllm.units import UnitCopy, unit_namespace

log = logging.getLogger(__name__)


class _Unstaged(Exception):
    """A save needs a block that was not copied out (the node lost it since the lookup)."""


class _NotAllStored(Exception):
    """The node did not take every block of a save (no room, or another writer's)."""


class SaveEnd(enum.Enum):
    """How a save ended, as the scheduler side is told (`KVStoreWorkerReport`)."""

    SAVED = "saved"
    """Every block is on the node: reported with the count."""
    PARTIAL = "partial"
    """Its first part (what fit in the staging budget) is on the node: reported with the
    count, the rest planned again next step."""
    RETRY = "retry"
    """Not (all) saved: planned again from the blocks confirmed so far."""
    RESTAGE = "restage"
    """The node lost a block before the copied-out ones: planned again from block 0."""
    NOT_STAGED = "not_staged"
    """Copying out failed before the save thread had it (the error goes to vLLM): nothing
    to report."""


SaveReport = Callable[[SaveSpec, SaveEnd, int], None]
"""How a save ended, for the worker's report: ``(save, end, leading blocks on the node)``."""


class SaveStager:
    """Copies a worker's saves out of vLLM's cache and stores them (module docstring)."""

    def __init__(
        self,
        link: NodeLink,
        order: BlockOrder,
        max_pending_save_bytes: int,
        report: SaveReport,
    ) -> None:
        self.link = link
        self.order = order
        self.max_pending_save_bytes = max_pending_save_bytes
        self._report = report
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")
        self._lock = threading.Lock()
        """Guards `_pending_bytes` and `_sent`."""
        self._pending_bytes = 0
        self._sent: set[str] = set()
        """Finished requests whose last blocks were copied out (or skipped): vLLM may
        free their blocks (`take_sent`)."""
        self._closed = False
        self.saved_blocks = 0
        """Blocks committed to the node so far."""

    def mark_sent(self, request_id: str) -> None:
        """vLLM may free the finished request's blocks (reported by `take_sent`)."""
        with self._lock:
            self._sent.add(request_id)

    def take_sent(self) -> set[str]:
        """Finished requests whose blocks vLLM may free now (their last save was copied
        out, or skipped), since the last call."""
        with self._lock:
            sent, self._sent = self._sent, set()
        return sent

    def shutdown(self) -> None:
        """Queued saves are dropped; a save under way ends at its next part."""
        self._closed = True
        self._saver.shutdown(wait=False, cancel_futures=True)

    def _room_for(self, block_bytes: int, wanted: int) -> int:
        """How many of ``wanted`` blocks fit in the staging budget now (lock held): at
        least one when nothing is staged, so a block over the budget still goes."""
        if not self._pending_bytes:
            return max(1, min(wanted, self.max_pending_save_bytes // block_bytes))
        return max(
            0, min(wanted, (self.max_pending_save_bytes - self._pending_bytes) // block_bytes)
        )

    def stage(self, save: SaveSpec, copy: UnitCopy) -> bool:
        """Copy out what fits in ``max_pending_save_bytes`` and hand it to the save thread.

        A save larger than the room left is staged in parts: a running request's first
        part now (reported saved so far, the rest planned again next step: its blocks
        stay vLLM's); a finished request's, whose blocks vLLM keeps until it is
        reported sent, part by part in the save thread (True: it reports it).
        """
        new_ids = save.block_ids[save.first_new :]
        block_bytes = copy.layout.block_bytes
        if self.link.down:
            self._report(save, SaveEnd.RETRY, 0)
            return False
        with self._lock:
            fits = self._room_for(block_bytes, len(new_ids)) if new_ids else 0
            if not new_ids or len(new_ids) <= fits or not save.frees_blocks:
                self._pending_bytes += fits * block_bytes
        if new_ids and fits < len(new_ids) and save.frees_blocks:
            self._saver.submit(self._run_save_in_parts, save, copy)
            return True
        if new_ids and fits <= 0:
            self._report(save, SaveEnd.RETRY, 0)
            return False
        nbytes = fits * block_bytes
        part = save
        if fits < len(new_ids):
            end = save.first_new + fits
            part = dataclasses.replace(
                save, hashes=save.hashes[:end], block_ids=save.block_ids[:end]
            )
        try:
            staged, ready = self._copy_out(part, copy)
        except BaseException:
            self._ended(save, nbytes, SaveEnd.NOT_STAGED)
            raise
        self._saver.submit(self._run_save, part, copy, staged, ready, nbytes, part is not save)
        return False

    def _copy_out(self, save: SaveSpec, copy: UnitCopy) -> tuple[torch.Tensor | None, Any]:
        """The save's new blocks copied out of vLLM's cache, and (CUDA) the copy's event."""
        new_ids = save.block_ids[save.first_new :]
        staged = gather_blocks(copy.layers, new_ids, copy.layout, self.order) if new_ids else None
        ready: Any = None
        if staged is not None and staged.is_cuda:
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()
        return staged, ready

    def _run_save(
        self,
        save: SaveSpec,
        copy: UnitCopy,
        staged: torch.Tensor | None,
        ready: Any,
        nbytes: int,
        partial: bool = False,
    ) -> None:
        end, blocks = SaveEnd.RETRY, 0
        try:
            if ready is not None:
                ready.synchronize()  # the copy-out, queued on the forward's stream
            blocks = self._store(save, copy, staged)
            end = SaveEnd.PARTIAL if partial else SaveEnd.SAVED
            self.link.succeeded()
        except Exception as exc:
            end = self._failed_save(save, exc)
        finally:
            self._ended(save, nbytes, end, blocks)

    def _run_save_in_parts(self, save: SaveSpec, copy: UnitCopy) -> None:
        """A finished request's save, larger than the staging budget: copied out and
        stored part by part as the budget allows (vLLM keeps its blocks until this
        reports it sent)."""
        end, first, total = SaveEnd.RETRY, save.first_new, len(save.hashes)
        block_bytes = copy.layout.block_bytes
        try:
            while first < total and not self._closed:
                # Never waits for room: the saves that hold the rest of the budget are
                # queued behind this one on the same thread, so at worst a part of one
                # block goes over the budget for the time of its store.
                with self._lock:
                    fits = max(1, self._room_for(block_bytes, total - first))
                    self._pending_bytes += fits * block_bytes
                nbytes = fits * block_bytes
                try:
                    part = dataclasses.replace(
                        save,
                        hashes=save.hashes[: first + fits],
                        block_ids=save.block_ids[: first + fits],
                        first_new=first,
                    )
                    staged, ready = self._copy_out(part, copy)
                    if ready is not None:
                        ready.synchronize()
                    self._store(part, copy, staged)
                finally:
                    self._release_bytes(nbytes)
                first += fits
            if first >= total:
                end = SaveEnd.SAVED
                self.link.succeeded()
        except Exception as exc:
            end = self._failed_save(save, exc)
        finally:
            self._ended(save, 0, end, first)
            self.mark_sent(save.request_id)

    def _failed_save(self, save: SaveSpec, exc: Exception) -> SaveEnd:
        """How a save that raised ``exc`` ended (logged as it deserves)."""
        if isinstance(exc, _Unstaged):
            return SaveEnd.RESTAGE
        if isinstance(exc, _NotAllStored):
            log.debug("kvstore: request %s not all saved: %s", save.request_id, exc)
        elif isinstance(exc, KVStoreError):
            self.link.failed("store on", exc)
        else:
            log.error("kvstore: saving request %s failed", save.request_id, exc_info=exc)
        return SaveEnd.RETRY

    def _store(self, save: SaveSpec, copy: UnitCopy, staged: torch.Tensor | None) -> int:
        ns = unit_namespace(self.link, copy, self.link.config.connect_timeout)
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

    def _release_bytes(self, nbytes: int) -> None:
        with self._lock:
            self._pending_bytes -= nbytes

    def _ended(self, save: SaveSpec, nbytes: int, end: SaveEnd, blocks: int = 0) -> None:
        """A save (or its part) ended: its bytes leave the budget, the worker reports it
        (``blocks``: leading blocks now on the node, when SAVED or PARTIAL)."""
        self._release_bytes(nbytes)
        self._report(save, end, blocks)
