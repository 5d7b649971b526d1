"""The scheduler side's lookups: one pinned Lookup per unit, polled, never waited on.

vLLM's scheduler thread asks `Lookups.answer` each step until the request's
lookups are answered: they run on the client's loop (`NodeLink.submit`), one
per unit (a KV cache group's namespace, per rank or shared: `units`), all
together; the request's hit is the shortest of them. A lookup not answered
within ``lookup_timeout`` is abandoned (what it pins when it lands is
released) and the request computed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence

from kvstore.client import Hit, Namespace, SyncClient
from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.node_link import NodeLink
from kvstore.integrations.vllm.request_life import Phase, TrackedRequest
from kvstore.types import BlockHash

IDLE_WAIT = 0.01
"""Seconds the scheduler thread may wait, once per step, for a lookup in flight when the
previous step scheduled nothing. vLLM then steps an empty batch about every millisecond
(engine core and workers), taking the CPU from the lookup's own thread (same process,
same GIL) and from the node; waiting instead lets the answer land sooner, and a new
request that arrives meanwhile waits at most this long. Never when anything runs."""


class Lookups:
    """A scheduler side's lookups on its link (module docstring)."""

    def __init__(self, link: NodeLink, clock: Callable[[], float]) -> None:
        self.link = link
        self._clock = clock
        self.may_wait = False
        """The last step scheduled nothing and no lookup was waited on since (`IDLE_WAIT`)."""

    def answer(self, tracked: TrackedRequest) -> bool:
        """Advance the admission's lookup; True once it is answered (or given up)."""
        budget = self.link.config.lookup_timeout
        overdue = self._clock() - tracked.asked_at >= budget
        life = tracked.life
        future = tracked.lookup
        if future is None:
            if self.link.down:  # a call failed lately: compute without asking (back-off)
                life.move(Phase.RUNNING)
                return True
            namespaces = self.link.namespaces()
            if namespaces is None:
                if self.link.connecting and not overdue:
                    return False
                life.move(Phase.RUNNING)
                return True
            client = self.link.client
            if client is not None:
                future = self.link.submit(
                    self._lookup_units(client, namespaces, tracked.chains, budget)
                )
            if future is None:
                life.move(Phase.RUNNING)
                return True
            tracked.lookup = future
            life.move(Phase.LOOKING_UP)
        if not future.done() and self.may_wait:
            self.may_wait = False  # once per step, however many requests wait
            concurrent.futures.wait([future], timeout=IDLE_WAIT)
        if not future.done():
            if not overdue:
                return False
            tracked.lookup = None
            life.move(Phase.RUNNING)
            self.abandon(future)
            self.link.failed("look up on", TimeoutError(f"no answer within {budget:g} s"))
            return True
        tracked.lookup = None
        try:
            hits = future.result()
        except (KVStoreError, concurrent.futures.CancelledError) as exc:
            life.move(Phase.RUNNING)
            self.link.failed("look up on", exc)
            return True
        hit_blocks = min(hit.hit_blocks for hit in hits)
        if hit_blocks:
            tracked.hits = hits
            tracked.saved_blocks = tracked.planned_blocks = hit_blocks
            life.move(Phase.HIT)
        else:
            life.move(Phase.RUNNING)
            for hit in hits:
                self.link.release(hit)
        return True

    async def _lookup_units(
        self,
        client: SyncClient,
        namespaces: Sequence[Namespace],
        chains: Sequence[list[BlockHash]],
        budget: float,
    ) -> list[Hit]:
        """Look up and pin each unit's chain in its namespace, together: all hits, or
        the first error (what the others pinned is released)."""
        answers = await asyncio.gather(
            *(
                client.client.lookup(
                    ns,
                    hashes=chain,
                    pin=True,
                    allow_remote=self.link.config.allow_remote,
                    timeout=budget,
                )
                for ns, chain in zip(namespaces, chains, strict=True)
            ),
            return_exceptions=True,
        )
        hits = [a for a in answers if isinstance(a, Hit)]
        for answer in answers:
            if isinstance(answer, BaseException):
                for hit in hits:
                    self.link.release(hit)
                raise answer
        return hits

    def abandon(self, future: concurrent.futures.Future[list[Hit]]) -> None:
        """Give up a lookup in flight: whatever it pins when it lands is released."""
        future.cancel()  # the SDK releases what a cancelled pinned lookup pinned

        def release_late(done: concurrent.futures.Future[list[Hit]]) -> None:
            if not done.cancelled() and done.exception() is None:
                for hit in done.result():
                    self.link.release(hit)

        future.add_done_callback(release_late)
