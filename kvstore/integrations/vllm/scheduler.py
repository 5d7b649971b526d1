"""The scheduler half of the connector: lookups, pins and the per-step plan.

Per request (vLLM calls these in the engine-core process):

1. ``get_num_new_matched_tokens``: the prompt's full blocks are hashed once
   (kvstore's own scheme from the tenant's chain root, see `docs/vllm.md`)
   and looked up **and pinned** on the node in one call. The answer is what
   the node has beyond vLLM's local hit, never the whole prompt: at least
   the last token is computed, so the hit is cut to ``(n - 1) // block``
   blocks. vLLM may ask again for a request it could not schedule; the
   pinned hit is kept and reused, never looked up twice.
2. ``update_state_after_alloc``: vLLM's final count (it may drop the hit)
   and the blocks it allocated: a load is planned, or the pins released.
3. ``build_connector_meta``: the step's loads go to the workers; the pins
   stay until a worker reports the load done (``update_connector_output``).
   Each scheduled request's newly completed full prompt blocks are planned
   as saves (the workers store them after the forward).
4. Pins are released when the load is done, when vLLM drops the hit, when
   the request is preempted, finishes or is aborted, and when the engine
   shuts down (closing the client ends the lease). A node that fails costs
   the reuse, never the request: every node error is logged and the request
   computed.
"""

from __future__ import annotations

import logging
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
    hit: Hit | None = None
    """The pinned lookup, until its load is done or it is dropped."""
    looked_up: bool = False
    """A lookup was made for this admission (never two)."""
    node_blocks: int = 0
    """Leading blocks the node had at lookup: saving starts after them."""
    local_tokens: int = 0
    """vLLM's (block-aligned) local hit when the hit was counted."""
    block_ids: list[int] = field(default_factory=list)
    """vLLM block ids of the request (first KV group), as allocated so far."""
    saved_blocks: int = 0
    """Leading full blocks known to be on the node or already planned for saving."""
    pending_load: LoadSpec | None = None
    """A load planned by `update_state_after_alloc`, sent with the next step."""


class SchedulerSide:
    """Scheduler-side state of the connector (one per engine)."""

    def __init__(
        self, link: NodeLink, block_size: int, *, load: bool, save: bool, extra_keys: ExtraKeysFn
    ) -> None:
        """Nothing is contacted here (see `NodeLink`)."""
        self.link = link
        self.block_size = block_size
        self.load = load
        self.save = save
        self._extra_keys = extra_keys
        self._requests: dict[str, _Tracked] = {}
        self._loading: dict[str, Hit] = {}
        """Pinned hits whose load was sent to the workers, until they report it done."""

    # --- hooks ---------------------------------------------------------------------------

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens the node has beyond ``num_computed_tokens`` that vLLM may load (block-aligned)."""
        tracked = self._track(request)
        if tracked is None or not self.load:
            return 0
        if not tracked.looked_up:
            tracked.looked_up = True
            tracked.hit = self._lookup(tracked.hashes)
            tracked.node_blocks = tracked.hit.hit_blocks if tracked.hit is not None else 0
            tracked.saved_blocks = tracked.node_blocks
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
        tracked.pending_load = LoadSpec(
            request_id=request.request_id,
            block_ids=tuple(block_ids[first:last]),
            slots=tuple(hit.slots[first:last].tolist()),
            epoch=hit.epoch,
            valid=self._still_pinned(hit),
            pool_version=hit.pool_version,
        )

    def build_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        """This step's loads and saves; releases the pins of preempted requests."""
        meta = KVStoreConnectorMetadata()
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._forget(req_id)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            self._plan(meta, new.req_id, tracked, new.num_computed_tokens + scheduled[new.req_id])
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
            self._plan(meta, req_id, tracked, cached.num_computed_tokens[i] + scheduled[req_id])
        return meta

    def on_worker_output(self, connector_output: Any) -> None:
        """Release the pins of loads the workers finished."""
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(report, KVStoreWorkerReport):
            return
        for req_id in report.loaded:
            hit = self._loading.pop(req_id, None)
            if hit is not None:
                self._release(hit)

    def request_finished(self, request_id: str) -> None:
        """The request is done (finished or aborted): release whatever it still pins."""
        self._forget(request_id)

    def shutdown(self) -> None:
        """Release every pin and close the client (its lease ends)."""
        for req_id in list(self._requests):
            self._forget(req_id)
        for hit in self._loading.values():
            self._release(hit)
        self._loading.clear()
        self.link.close()

    @property
    def pinned_requests(self) -> int:
        """Requests holding pins now (for tests and logs)."""
        held = sum(1 for t in self._requests.values() if t.hit is not None and not t.hit.released)
        return held + len(self._loading)

    # --- internals -------------------------------------------------------------------------

    def _track(self, request: Any) -> _Tracked | None:
        tracked = self._requests.get(request.request_id)
        if tracked is not None:
            return tracked
        hashes = self._hash_prompt(request)
        if hashes is None:
            return None
        tracked = self._requests[request.request_id] = _Tracked(hashes=hashes)
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

    def _lookup(self, hashes: list[BlockHash]) -> Hit | None:
        ns = self.link.namespace()
        client = self.link.client
        if ns is None or client is None:
            return None
        try:
            hit = client.lookup(
                ns, hashes=hashes, pin=True, timeout=self.link.config.lookup_timeout
            )
        except KVStoreError as exc:
            self.link.failed("look up on", exc)
            return None
        if hit.hit_blocks == 0:
            return None
        return hit

    def _still_pinned(self, hit: Hit) -> bool:
        client = self.link.client
        if client is None or hit.released:
            return False
        return hit.lease_generation == client.client.lease.generation

    def _plan(
        self, meta: KVStoreConnectorMetadata, req_id: str, tracked: _Tracked, computed: int
    ) -> None:
        if tracked.pending_load is not None:
            load, tracked.pending_load = tracked.pending_load, None
            meta.loads.append(load)
            if tracked.hit is not None:
                self._loading[req_id] = tracked.hit
                tracked.hit = None
        if not self.save:
            return
        full = min(computed // self.block_size, len(tracked.hashes), len(tracked.block_ids))
        if full <= tracked.saved_blocks:
            return
        meta.saves.append(
            SaveSpec(
                request_id=req_id,
                hashes=tuple(tracked.hashes[:full]),
                block_ids=tuple(tracked.block_ids[:full]),
                first_new=tracked.saved_blocks,
            )
        )
        tracked.saved_blocks = full

    def _drop_hit(self, tracked: _Tracked) -> None:
        hit, tracked.hit = tracked.hit, None
        if hit is not None:
            self._release(hit)

    def _forget(self, req_id: str) -> None:
        tracked = self._requests.pop(req_id, None)
        if tracked is not None:
            self._drop_hit(tracked)
        hit = self._loading.pop(req_id, None)
        if hit is not None:
            self._release(hit)

    def _release(self, hit: Hit) -> None:
        client = self.link.client
        if client is None or hit.released:
            return
        try:
            client.release(hit, timeout=self.link.config.lookup_timeout)
        except KVStoreError as exc:  # the lease drops the pins when it ends
            self.link.failed("release pins on", exc)
