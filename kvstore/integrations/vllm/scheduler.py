"""The scheduler half of the connector: lookups, pins and the per-step plan.

vLLM calls these in the engine-core process, on its scheduler thread, which
must never wait on the node (`docs/vllm.md`, "Never stalls vLLM"):

1. ``get_num_new_matched_tokens``: the prompt's full blocks are hashed once
   (kvstore's own scheme from the tenant's chain root) and a Lookup **with
   pin** is started in the background. While it is in flight the answer is
   ``None`` (vLLM asks again next step); a lookup not answered within
   ``lookup_timeout`` of the first ask is given up (the request is computed,
   and whatever the late answer pinned is released). The answer is what the
   node has beyond vLLM's local hit, cut so that at least the last token is
   computed. The load is asynchronous: vLLM keeps the request waiting until
   the worker reports it.
2. ``update_state_after_alloc``: vLLM's final count (it may drop the hit)
   and its blocks: a load is planned, or the pins released.
3. ``build_connector_meta``: every planned load goes to the workers with the
   time until which its pins are surely held (`NodeLink.pins_held_until`);
   each scheduled request's newly computed full prompt blocks are planned as
   saves.
4. ``update_connector_output``: the workers' report. A load's pins are
   released only once the worker reported that load finished, whatever
   happened to the request meanwhile (finished, aborted: vLLM schedules a
   step ahead, the copy may still be queued). A request's saved blocks
   advance only on a confirmed commit; a save that did not happen is
   planned again; a request whose blocks touched a failed load is never
   saved.
5. Releases go out in the background (`NodeLink.release`); closing the
   client at shutdown ends the lease, dropping whatever is still pinned.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.client import Hit
from kvstore.errors import KVStoreError
from kvstore.hashing import Extra, cbor_encode
from kvstore.integrations.vllm.link import NodeLink
from kvstore.integrations.vllm.metadata import (
    KVStoreConnectorMetadata,
    KVStoreWorkerReport,
    LoadSpec,
    SaveSpec,
)
from kvstore.types import BlockHash

log = logging.getLogger(__name__)

ExtraKeysFn = Any
"""vLLM's ``generate_block_hash_extra_keys(request, start, end, mm_index)``."""


@dataclass(slots=True)
class _Tracked:
    """What the scheduler side knows about one request."""

    hashes: list[BlockHash]
    """Chain hashes of the prompt's full blocks."""
    asked_at: float
    """When vLLM first asked for this admission (the lookup's time budget starts)."""
    lookup: concurrent.futures.Future[Hit] | None = None
    """The Lookup in flight, if any."""
    looked_up: bool = False
    """The lookup of this admission is answered or given up (never two)."""
    hit: Hit | None = None
    """The pinned hit, until a load is planned with it or it is dropped."""
    local_tokens: int = 0
    """vLLM's (block-aligned) local hit when the hit was counted."""
    block_ids: list[int] = field(default_factory=list)
    """vLLM block ids of the request (first KV group), as allocated so far."""
    saved_blocks: int = 0
    """Leading full blocks the node is known to have (at lookup, or a confirmed commit):
    saving starts after them."""
    planned_blocks: int = 0
    """Leading full blocks saved or planned for saving."""
    poisoned: bool = False
    """Never save this request (its blocks touched a failed load's)."""


class SchedulerSide:
    """Scheduler-side state of the connector (one per engine)."""

    def __init__(
        self,
        link: NodeLink,
        block_size: int,
        *,
        load: bool,
        save: bool,
        extra_keys: ExtraKeysFn,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Nothing is contacted here (see `NodeLink`)."""
        self.link = link
        self.block_size = block_size
        self.load = load
        self.save = save
        self._extra_keys = extra_keys
        self._clock = clock
        self._requests: dict[str, _Tracked] = {}
        self._pending_loads: dict[str, tuple[LoadSpec, Hit]] = {}
        """Loads planned by `after_alloc`, sent with the next step (always: vLLM waits)."""
        self._loading: dict[str, Hit] = {}
        """Pinned hits whose load was sent to the workers, until they report it finished."""
        self._failures_seen = 0
        self._first_ask: dict[str, float] = {}
        """Requests asked about while the namespace was being registered: since when."""

    # --- hooks ---------------------------------------------------------------------------

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens the node has beyond ``num_computed_tokens`` (block-aligned); None: ask again."""
        tracked = self._track(request)
        if tracked is None:
            # Before the namespace is registered there is no chain root to hash with:
            # wait for a registration in flight, within the lookup's budget.
            if not self.link.connecting:
                self._first_ask.pop(request.request_id, None)
                return 0
            first = self._first_ask.setdefault(request.request_id, self._clock())
            if self._clock() - first < self.link.config.lookup_timeout:
                return None
            self._first_ask.pop(request.request_id, None)
            return 0
        if not self.load:
            return 0
        if not tracked.looked_up and not self._answer_lookup(tracked):
            return None
        hit = tracked.hit
        if hit is None or hit.released:
            return 0
        usable = min(hit.hit_blocks, (int(request.num_tokens) - 1) // self.block_size)
        external = usable * self.block_size - num_computed_tokens
        tracked.local_tokens = num_computed_tokens
        return max(external, 0)

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """Plan the load vLLM accepted, or release the pins it did not take."""
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            return
        tracked.block_ids = list(block_ids)
        hit = tracked.hit
        if num_external_tokens <= 0 or hit is None:
            self._drop_hit(tracked)
            return
        first = tracked.local_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        tracked.hit = None
        self._pending_loads[request.request_id] = (
            LoadSpec(
                request_id=request.request_id,
                block_ids=tuple(block_ids[first:last]),
                slots=tuple(hit.slots[first:last].tolist()),
                epoch=hit.epoch,
                pins_until=0.0,
                pool_version=hit.pool_version,
            ),
            hit,
        )

    def build_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        """This step's loads and saves; forgets preempted requests."""
        meta = KVStoreConnectorMetadata(failures_seen=self._failures_seen)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._forget(req_id)
        for req_id, (load, hit) in self._pending_loads.items():
            # Read now, as late as possible: the keeper renews the lease meanwhile.
            pins_until = self.link.pins_held_until(hit)
            meta.loads.append(dataclasses.replace(load, pins_until=pins_until))
            self._loading[req_id] = hit
        self._pending_loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            self._plan_save(
                meta, new.req_id, tracked, new.num_computed_tokens + scheduled[new.req_id]
            )
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                tracked.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            self._plan_save(
                meta, req_id, tracked, cached.num_computed_tokens[i] + scheduled[req_id]
            )
        return meta

    def on_worker_output(self, connector_output: Any) -> None:
        """Act on the workers' report: release finished loads' pins, account for saves."""
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(report, KVStoreWorkerReport):
            return
        self._failures_seen = max(self._failures_seen, report.failure_seq)
        for req_id in report.loaded:
            hit = self._loading.pop(req_id, None)
            if hit is not None:
                self.link.release(hit)
        for req_id in report.poisoned:
            tracked = self._requests.get(req_id)
            if tracked is not None:
                tracked.poisoned = True
        for req_id, blocks in report.saved.items():
            tracked = self._requests.get(req_id)
            if tracked is not None:
                tracked.saved_blocks = max(tracked.saved_blocks, blocks)
        for req_id, restage in report.unsaved.items():
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            if restage:  # the node lost an older block: copy them all out next time
                tracked.saved_blocks = 0
            tracked.planned_blocks = tracked.saved_blocks  # planned again next step

    def request_finished(self, request_id: str) -> None:
        """The request is done (finished or aborted): drop what it still pins.

        A load already sent to the workers keeps its pins until they report it.
        """
        self._forget(request_id)

    def shutdown(self) -> None:
        """Close the client: its lease ends on the node, dropping every pin.

        vLLM may go on scheduling (draining requests after a stop signal): planned
        loads are still sent, and fail (their pins are gone), so every request vLLM
        keeps waiting for its load is reported; nothing new is looked up or saved.
        """
        for tracked in self._requests.values():
            if tracked.lookup is not None:
                tracked.lookup.cancel()
        self._requests.clear()
        self._loading.clear()
        self.link.close()

    @property
    def pins_in_use(self) -> int:
        """Hits pinned (or being looked up) that a request may still read (for tests and logs)."""
        held = sum(
            1
            for t in self._requests.values()
            if t.lookup is not None or (t.hit is not None and not t.hit.released)
        )
        return held + len(self._pending_loads) + len(self._loading)

    # --- internals -------------------------------------------------------------------------

    def _answer_lookup(self, tracked: _Tracked) -> bool:
        """Advance the admission's lookup; True once it is answered (or given up)."""
        budget = self.link.config.lookup_timeout
        overdue = self._clock() - tracked.asked_at >= budget
        future = tracked.lookup
        if future is None:
            if self.link.down:  # a call failed lately: compute without asking (back-off)
                tracked.looked_up = True
                return True
            ns = self.link.namespace()
            if ns is None:
                if self.link.connecting and not overdue:
                    return False
                tracked.looked_up = True
                return True
            client = self.link.client
            if client is not None:
                lookup = client.client.lookup(ns, hashes=tracked.hashes, pin=True, timeout=budget)
                future = self.link.submit(lookup)
            if future is None:
                tracked.looked_up = True
                return True
            tracked.lookup = future
        if not future.done():
            if not overdue:
                return False
            tracked.lookup = None
            tracked.looked_up = True
            self._abandon(future)
            self.link.failed("look up on", TimeoutError(f"no answer within {budget:g} s"))
            return True
        tracked.lookup = None
        tracked.looked_up = True
        try:
            hit = future.result()
        except (KVStoreError, concurrent.futures.CancelledError) as exc:
            self.link.failed("look up on", exc)
            return True
        if hit.hit_blocks:
            tracked.hit = hit
            tracked.saved_blocks = tracked.planned_blocks = hit.hit_blocks
        return True

    def _abandon(self, future: concurrent.futures.Future[Hit]) -> None:
        """Give up a lookup in flight: whatever it pins when it lands is released."""
        future.cancel()  # the SDK releases what a cancelled pinned lookup pinned

        def release_late(done: concurrent.futures.Future[Hit]) -> None:
            if not done.cancelled() and done.exception() is None:
                self.link.release(done.result())

        future.add_done_callback(release_late)

    def _track(self, request: Any) -> _Tracked | None:
        tracked = self._requests.get(request.request_id)
        if tracked is not None:
            return tracked
        hashes = self._hash_prompt(request)
        if hashes is None:
            return None
        asked_at = self._first_ask.pop(request.request_id, None) or self._clock()
        tracked = _Tracked(hashes=hashes, asked_at=asked_at)
        self._requests[request.request_id] = tracked
        return tracked

    def _hash_prompt(self, request: Any) -> list[BlockHash] | None:
        tokens = request.prompt_token_ids
        if tokens is None or getattr(request, "prompt_embeds", None) is not None:
            return None  # prompt embeddings have no tokens to key them by
        n_blocks = len(tokens) // self.block_size
        if n_blocks == 0:
            return None
        ns = self.link.namespace()
        if ns is None:
            return None
        try:
            return ns.hash(tokens[: n_blocks * self.block_size], self._extras(request, n_blocks))
        except Exception as exc:  # an extra key kvstore cannot encode: do not cache it
            log.warning("kvstore: request %s is not cached: %s", request.request_id, exc)
            return None

    def _extras(self, request: Any, n_blocks: int) -> list[Extra] | None:
        """Per-block extra hash input (LoRA name, multimodal hashes, cache salt) as bytes."""
        if not (
            getattr(request, "lora_request", None)
            or getattr(request, "mm_features", None)
            or getattr(request, "cache_salt", None)
        ):
            return None
        extras: list[Extra] = []
        mm_index = 0
        for i in range(n_blocks):
            keys, mm_index = self._extra_keys(
                request, i * self.block_size, (i + 1) * self.block_size, mm_index
            )
            extras.append(cbor_encode(keys) if keys else None)
        return extras

    def _plan_save(
        self, meta: KVStoreConnectorMetadata, req_id: str, tracked: _Tracked, computed: int
    ) -> None:
        if not self.save or tracked.poisoned:
            return
        full = min(computed // self.block_size, len(tracked.hashes), len(tracked.block_ids))
        if full <= tracked.planned_blocks:
            return
        meta.saves.append(
            SaveSpec(
                request_id=req_id,
                hashes=tuple(tracked.hashes[:full]),
                block_ids=tuple(tracked.block_ids[:full]),
                first_new=tracked.planned_blocks,
            )
        )
        tracked.planned_blocks = full

    def _drop_hit(self, tracked: _Tracked) -> None:
        hit, tracked.hit = tracked.hit, None
        if hit is not None:
            self.link.release(hit)

    def _forget(self, req_id: str) -> None:
        """Stop tracking a request; a load sent or about to be sent keeps its pins."""
        self._first_ask.pop(req_id, None)
        tracked = self._requests.pop(req_id, None)
        if tracked is None:
            return
        if tracked.lookup is not None:
            self._abandon(tracked.lookup)
            tracked.lookup = None
        self._drop_hit(tracked)
