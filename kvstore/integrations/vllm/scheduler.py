"""The scheduler half of the connector: lookups, pins and the per-step plan.

vLLM calls these on its scheduler thread, which never waits on the node
(`docs/vllm.md`, "Never stalls vLLM"):

1. ``get_num_new_matched_tokens``: a Lookup **with pin** per unit (a KV cache
   group's namespace, per rank or shared: `units`) starts in
   the background; ``None`` ("ask again") while in flight, given up after
   ``lookup_timeout``. The answer is what the node has beyond vLLM's local
   hit, leaving at least the last token to compute.
2. ``update_state_after_alloc``: a load is planned, or the pins released.
3. ``build_connector_meta``: loads go to the workers with the time their
   pins are surely held until (`NodeLink.pins_held_until`) and each slot's
   stamp; newly computed full blocks are planned as saves.
4. ``update_connector_output``: a unit's pins are released once every rank
   that copies it reported its load; saves advance only on a confirmed commit; a request
   whose blocks touched a failed load is never saved.
5. ``request_finished``: unsaved last blocks keep the request's blocks
   (``delay_free``) until the workers copied them out.
6. ``shutdown`` ends the lease, unless a load is in flight (it then expires,
   so the pins hold as long as the workers were told).

A request's phase lives in `request_life`; the worker proves every load
with the slots' stamps, so a slip here costs a recompute, never wrong KV.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.integrations.vllm.chains import ExtraKeysFn, RequestChains
from kvstore.integrations.vllm.lookups import Lookups
from kvstore.integrations.vllm.metadata import (
    NULL_BLOCK,
    KVStoreConnectorMetadata,
    KVStoreWorkerReport,
    SaveSpec,
    plan_loads,
)
from kvstore.integrations.vllm.node_link import NodeLink
from kvstore.integrations.vllm.request_life import Phase, TrackedRequest
from kvstore.integrations.vllm.units import Unit, default_units

log = logging.getLogger(__name__)


class SchedulerSide:
    """Scheduler-side state of the connector (one per engine)."""

    def __init__(
        self,
        link: NodeLink,
        block_size: int,
        *,
        load: bool,
        save: bool,
        save_decode: bool = True,
        extra_keys: ExtraKeysFn,
        units: Sequence[Unit] | None = None,
        tp: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Nothing is contacted here (see `NodeLink`).

        Args:
            units: the link's namespaces, in its order (`units.engine_units`); by
                default one full-attention group, unit ``i`` being rank ``i``'s.
            tp: the tensor-parallel size (by default, the number of units).
        """
        self.link = link
        self.units = list(units) if units is not None else default_units(link)
        self.tp = tp if tp is not None else len(self.units)
        self.block_size = block_size
        self.load = load
        self.save = save
        self.save_decode = save_decode
        self._chains = RequestChains(link, block_size, extra_keys)
        self._clock = clock
        self._requests: dict[str, TrackedRequest] = {}
        """Every request with a phase other than DONE (a finished one while DRAINING)."""
        self._planned: list[str] = []
        """Requests whose loads `after_alloc` planned, sent with the next step (always:
        vLLM waits for them)."""
        self._final_saves: list[SaveSpec] = []
        """Saves of finished requests whose blocks vLLM keeps until the workers report them."""
        self._failures_seen = 0
        self._first_ask: dict[str, float] = {}
        """Requests asked about while the namespace was being registered: since when."""
        self._lookups = Lookups(link, clock)

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
        life = tracked.life
        if life.phase is Phase.NEW and (
            not self.load or getattr(request, "skip_reading_prefix_cache", False)
        ):
            # Prompt logprobs need every prompt token computed: vLLM zeroes a hit itself,
            # so a lookup would pin blocks for nothing. Its blocks are still saved.
            life.move(Phase.RUNNING)
            return 0
        if life.phase in (Phase.NEW, Phase.LOOKING_UP) and not self._lookups.answer(tracked):
            return None
        hits = tracked.hits
        if life.phase is not Phase.HIT or not hits:
            return 0
        if any(hit.released for hit in hits):  # the lease was lost: so were the pins
            self._drop_hit(tracked)
            return 0
        hit_blocks = min(hit.hit_blocks for hit in hits)
        usable = min(hit_blocks, (int(request.num_tokens) - 1) // self.block_size)
        external = usable * self.block_size - num_computed_tokens
        tracked.local_tokens = num_computed_tokens
        return max(external, 0)

    def after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """Plan the load vLLM accepted, or release the pins it did not take.

        ``block_ids``: the request's vLLM block ids, one list per KV cache group.
        """
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            return
        tracked.block_ids = [list(ids) for ids in block_ids]
        hits = tracked.hits
        if tracked.life.phase is not Phase.HIT or not hits:
            return
        if num_external_tokens <= 0:
            self._drop_hit(tracked)
            return
        first = tracked.local_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        per_unit = [tracked.block_ids[unit.group.index] for unit in self.units]
        tracked.loads = plan_loads(request.request_id, hits, per_unit, first, last)
        tracked.life.move(Phase.LOAD_PLANNED)
        self._planned.append(request.request_id)

    def build_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        """This step's loads and saves; forgets preempted requests."""
        idle = not any(scheduler_output.num_scheduled_tokens.values())
        meta = KVStoreConnectorMetadata(failures_seen=self._failures_seen, idle=idle)
        self._lookups.may_wait = idle
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._forget(req_id)
        for req_id in self._planned:
            tracked = self._requests.get(req_id)
            if tracked is None or not tracked.loads or tracked.hits is None:
                continue
            for load, hit in zip(tracked.loads, tracked.hits, strict=True):
                # Read now, as late as possible: the keeper renews the lease meanwhile.
                pins_until = self.link.pins_held_until(hit)
                meta.loads.append(dataclasses.replace(load, pins_until=pins_until))
            tracked.loads = []
            tracked.pending = {
                (unit, rank) for unit in range(len(self.units)) for rank in self._loaders(unit)
            }
            if tracked.life.phase is Phase.LOAD_PLANNED:
                tracked.life.move(Phase.LOADING)
        self._planned.clear()
        meta.saves.extend(self._final_saves)
        self._final_saves.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = [list(ids) for ids in new.block_ids]
            self._plan_save(
                meta.saves,
                tracked,
                new.num_computed_tokens + scheduled[new.req_id],
                before=new.num_computed_tokens,
            )
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                tracked.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                for group_ids, more in zip(tracked.block_ids, new_ids, strict=True):
                    group_ids.extend(more)
            before = cached.num_computed_tokens[i]
            self._plan_save(meta.saves, tracked, before + scheduled[req_id], before=before)
        return meta

    def on_worker_output(self, connector_output: Any) -> None:
        """Act on the workers' report: release finished loads' pins, account for saves."""
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(report, KVStoreWorkerReport):
            return
        self._failures_seen = max(self._failures_seen, report.failure_seq)
        for (req_id, unit), slots in report.corrupt.items():
            tracked = self._requests.get(req_id)
            if tracked is not None:
                tracked.corrupt.setdefault(unit, set()).update(slots)
        for req_id, rank in report.loaded:
            self._rank_loaded(req_id, rank)
        for req_id in report.poisoned:
            tracked = self._requests.get(req_id)
            if tracked is not None:
                tracked.poisoned = True
        for (req_id, unit), blocks in report.saved.items():
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            by_unit = tracked.saved_by_unit
            by_unit[unit] = max(by_unit.get(unit, 0), blocks)
            everywhere = min(by_unit.get(u, 0) for u in range(len(tracked.chains)))
            tracked.saved_blocks = max(tracked.saved_blocks, everywhere)
        for req_id, restage in report.unsaved.items():
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            if restage:  # the node lost an older block: copy them all out next time
                tracked.saved_blocks = 0
                tracked.saved_by_unit.clear()
            tracked.planned_blocks = tracked.saved_blocks  # planned again next step

    def _rank_loaded(self, req_id: str, rank: int) -> None:
        """One rank finished copying its loads (done or failed): the pins of the units no
        other rank still copies may go; once every rank has, the request runs (or,
        finished meanwhile, is forgotten)."""
        tracked = self._requests.get(req_id)
        if tracked is None or not tracked.life.in_flight:
            return  # a report of a load this side no longer holds (never twice)
        mine = {(unit, r) for unit, r in tracked.pending if r == rank}
        if not mine:
            return
        tracked.pending -= mine
        still = {unit for unit, _ in tracked.pending}
        if tracked.hits is not None:
            for unit in {unit for unit, _ in mine} - still:
                hit, bad = tracked.hits[unit], tracked.corrupt.pop(unit, set())
                corrupt = [i for i, slot in enumerate(hit.slots.tolist()) if slot in bad]
                self.link.release(hit, corrupt)
        if tracked.pending:
            return
        tracked.hits = None
        if tracked.life.phase is Phase.LOADING:
            tracked.life.move(Phase.RUNNING)
        else:
            tracked.life.move(Phase.DONE)
            del self._requests[req_id]

    def request_finished(self, request: Any, block_ids: Sequence[Sequence[int]]) -> bool:
        """The request is done (finished or aborted): drop what it still pins.

        A load already sent to the workers keeps its pins until every rank reports it.
        ``block_ids``: the request's vLLM block ids, one list per KV cache group (a
        sliding window's blocks outside it are vLLM's null block).

        Returns:
            True when vLLM must keep the request's blocks until the workers report it
            in ``finished_sending``: its last full blocks are to be copied out next step.
        """
        request_id = request.request_id
        tracked = self._requests.get(request_id)
        delay = False
        if tracked is not None and any(block_ids) and tracked.life.phase is Phase.RUNNING:
            tracked.block_ids = [list(ids) for ids in block_ids]
            computed = int(getattr(request, "num_computed_tokens", 0))
            delay = self._plan_save(self._final_saves, tracked, computed, frees_blocks=True)
        self._forget(request_id)
        return delay

    def shutdown(self) -> None:
        """Close the client; its lease ends on the node, dropping every pin, unless a load
        is in flight.

        A worker may still be copying a load this side sent: then the lease is left to
        expire by itself (nothing renews it once the client is closed), so the pins hold
        as long as the workers were told (`LoadSpec.pins_until`). vLLM may go on
        scheduling (draining requests after a stop signal): planned loads are still
        sent, and fail, so every request vLLM keeps waiting for its load is reported;
        nothing new is looked up or saved.
        """
        in_flight = any(t.life.in_flight or t.loads for t in self._requests.values())
        for tracked in self._requests.values():
            if tracked.lookup is not None:
                tracked.lookup.cancel()
        self._requests.clear()
        self._planned.clear()
        self.link.close(end_lease=not in_flight)
        # Saves of finished requests are still sent (the workers skip them but report
        # them), or vLLM would hold their blocks for ever.

    @property
    def pins_in_use(self) -> int:
        """Requests holding pins (or looking up) that a worker may still read (for tests and
        logs)."""
        return sum(
            1
            for t in self._requests.values()
            if t.life.phase is Phase.LOOKING_UP
            or (t.life.pinned and any(not hit.released for hit in t.hits or ()))
        )

    def phase(self, request_id: str) -> Phase:
        """The phase of a request (DONE when not tracked)."""
        tracked = self._requests.get(request_id)
        return tracked.life.phase if tracked is not None else Phase.DONE

    # --- internals -------------------------------------------------------------------------

    def _track(self, request: Any) -> TrackedRequest | None:
        tracked = self._requests.get(request.request_id)
        if tracked is not None:
            return tracked
        prompt = request.prompt_token_ids
        if prompt is None or getattr(request, "prompt_embeds", None) is not None:
            return None  # prompt embeddings have no tokens to key them by
        # All tokens, not just the prompt: a request resumed after preemption finds
        # the output blocks it saved before.
        n_blocks = int(request.num_tokens) // self.block_size
        if n_blocks == 0:
            return None
        chains = self._chains.extend(request, None, n_blocks)
        if chains is None:
            return None
        asked_at = self._first_ask.pop(request.request_id, None) or self._clock()
        tracked = TrackedRequest(
            request=request,
            chains=chains,
            prompt_blocks=len(prompt) // self.block_size,
            asked_at=asked_at,
        )
        self._requests[request.request_id] = tracked
        return tracked

    def _plan_save(
        self,
        saves: list[SaveSpec],
        tracked: TrackedRequest,
        computed: int,
        *,
        before: int | None = None,
        frees_blocks: bool = False,
    ) -> bool:
        """Plan the save of the request's new full blocks whose KV is ``computed``; True
        when one was planned.

        ``before``: tokens computed before this step. vLLM freed a sliding-window
        group's blocks before the window of that point when it scheduled the step (they
        are its null block now): those are never saved.
        """
        if not self.save or tracked.poisoned:
            return False
        request = tracked.request
        # Known tokens only: with asynchronous scheduling the token a step computes
        # may not be sampled into the request yet.
        full = min(computed, int(request.num_tokens)) // self.block_size
        if not self.save_decode:
            full = min(full, tracked.prompt_blocks)
        full = min(full, *(len(ids) for ids in tracked.block_ids)) if tracked.block_ids else 0
        if full <= tracked.planned_blocks:
            return False
        chains = self._chains.extend(request, tracked.chains, full)
        if chains is None:
            if self.link.namespaces() is None:
                # Not registered right now (the node restarted: its namespace is being
                # registered again; or it is down): plan in a later step, once it is.
                return False
            tracked.poisoned = True  # cannot be keyed: never saved
            return False
        tracked.chains = chains
        first = tracked.planned_blocks
        for unit_index, (unit, chain) in enumerate(zip(self.units, chains, strict=True)):
            ids = tracked.block_ids[unit.group.index]
            if before is not None:
                for i in range(min(unit.group.first_needed_block(before), len(ids))):
                    ids[i] = NULL_BLOCK  # freed by vLLM when it scheduled this step
            if NULL_BLOCK in ids[first:full]:
                continue  # left the window before it was saved: this group stops here
            saves.append(
                SaveSpec(
                    request_id=request.request_id,
                    hashes=tuple(chain[:full]),
                    block_ids=tuple(ids[:full]),
                    first_new=first,
                    frees_blocks=frees_blocks,
                    unit=unit_index,
                )
            )
        tracked.planned_blocks = full
        return True

    def _loaders(self, unit: int) -> frozenset[int]:
        """The ranks that copy ``unit``'s blocks on a hit."""
        return self.units[unit].loaders or frozenset(range(self.tp))

    def _drop_hit(self, tracked: TrackedRequest) -> None:
        """HIT: vLLM did not take the hit (or its pins were lost): release it and compute."""
        hits, tracked.hits = tracked.hits, None
        tracked.life.move(Phase.RUNNING)
        for hit in hits or ():
            self.link.release(hit)

    def _forget(self, req_id: str) -> None:
        """vLLM is done with a request (finished, aborted, preempted): release what it pins,
        unless a worker may be copying it (DRAINING until every rank reports)."""
        self._first_ask.pop(req_id, None)
        tracked = self._requests.get(req_id)
        if tracked is None:
            return
        life = tracked.life
        if life.in_flight or life.phase is Phase.LOAD_PLANNED:
            if life.phase is not Phase.DRAINING:
                # A planned load is still sent with the next step (vLLM waits for it).
                life.move(Phase.DRAINING)
            return
        del self._requests[req_id]
        if tracked.lookup is not None:
            self._lookups.abandon(tracked.lookup)
            tracked.lookup = None
        hits, tracked.hits = tracked.hits, None
        life.move(Phase.DONE)
        for hit in hits or ():
            self.link.release(hit)
