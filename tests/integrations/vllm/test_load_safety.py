"""Pins a worker may copy from are held until that worker says it is done (no vLLM).

The scheduler side against a real in-process node: a tensor-parallel load whose
ranks report in different steps, a shutdown with a load in flight, and a request
that must not look up at all (prompt logprobs).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

from kvstore.integrations.vllm.metadata import KVStoreWorkerReport
from kvstore.integrations.vllm.request_life import Phase
from service.server import Server
from tests.integrations.vllm.scheduler_fakes import (
    BS,
    MODEL,
    answer,
    pinned,
    prefill_step,
    request,
    scheduler_side,
    step,
    store_prompt,
)
from tests.waiting import wait_until

RANKS = [f"{MODEL}#tp-2.0", f"{MODEL}#tp-2.1"]


def report(**fields: object) -> SimpleNamespace:
    return SimpleNamespace(kv_connector_worker_meta=KVStoreWorkerReport(**fields))  # type: ignore[arg-type]


def pins_drop_to(address: str, want: int) -> int:
    """Pinned blocks once they reach ``want`` (releases go out in the background), or
    what they are after 10 s."""
    with contextlib.suppress(AssertionError):  # the caller's assert names what went wrong
        wait_until(lambda: pinned(address) == want, within=10, interval=0.02, what=f"{want} pins")
    return pinned(address)


async def test_one_ranks_report_releases_only_that_ranks_pins(
    kv_server: Server,
) -> None:
    """vLLM hands the scheduler each step's reports only: rank 0 done says nothing of
    rank 1, which may still be copying (and would copy reused slots if its pins went)."""
    address = kv_server.address

    def scenario() -> None:
        tokens = [*range(900, 900 + 3 * BS), 1]
        for model in RANKS:
            assert store_prompt(address, tokens, model) == 3
        side = scheduler_side(address, RANKS, lookup_timeout=5.0)
        try:
            req = request("tp", tokens)
            assert answer(side, req) == 3 * BS
            side.after_alloc(req, [[20, 21, 22, 23]], 3 * BS)
            assert len(side.build_meta(prefill_step(req, [20, 21, 22, 23])).loads) == 2
            assert side.phase("tp") is Phase.LOADING
            side.on_worker_output(report(loaded={("tp", 0)}))
            assert pins_drop_to(address, 3) == 3, "rank 1's pins went with rank 0's report"
            assert side.phase("tp") is Phase.LOADING
            # vLLM aborts the request meanwhile: rank 1 still copies, its pins stay.
            assert side.request_finished(req, [[]]) is False
            assert side.phase("tp") is Phase.DRAINING
            time.sleep(0.2)  # not waiting for an event: time passes and rank 1's pins stay
            assert pinned(address) == 3
            side.on_worker_output(report(loaded={("tp", 1)}))
            assert pins_drop_to(address, 0) == 0
            assert side.phase("tp") is Phase.DONE and side.pins_in_use == 0
            # A late duplicate report changes nothing.
            side.on_worker_output(report(loaded={("tp", 0), ("tp", 1)}))
        finally:
            side.shutdown()

    await asyncio.to_thread(scenario)


async def test_shutdown_with_a_load_in_flight_keeps_the_pins_until_the_lease_expires(
    kv_server: Server,
) -> None:
    """SIGTERM closes the scheduler's connector before vLLM's workers stop: ending the
    lease then would drop the pins of a copy under way. It is left to expire instead."""
    address = kv_server.address

    def scenario() -> None:
        tokens = [*range(1200, 1200 + 2 * BS), 1]
        assert store_prompt(address, tokens) == 2
        side = scheduler_side(address, lookup_timeout=5.0)
        req = request("sd", tokens)
        assert answer(side, req) == 2 * BS
        side.after_alloc(req, [[1, 2, 3]], 2 * BS)
        (load,) = side.build_meta(step()).loads
        side.shutdown()
        assert pinned(address) == 2, "shutdown dropped the pins of a load in flight"
        assert load.pins_until > time.monotonic()
        # With nothing in flight, shutdown ends the lease at once.
        other = scheduler_side(address, lookup_timeout=5.0)
        again = request("sd2", [*range(1200, 1200 + 2 * BS), 5])
        assert answer(other, again) == 2 * BS
        assert pinned(address) == 4  # the same blocks, pinned again (a second lease)
        other.shutdown()
        assert pinned(address) == 2  # only the first lease's pins are left

    await asyncio.to_thread(scenario)


async def test_a_request_that_skips_the_prefix_cache_is_never_looked_up(
    kv_server: Server,
) -> None:
    """Prompt logprobs need every prompt token computed: vLLM zeroes any hit itself, so
    the connector stands aside before the lookup and pins nothing."""
    address = kv_server.address

    def scenario() -> None:
        tokens = [*range(1500, 1500 + 2 * BS), 1]
        assert store_prompt(address, tokens) == 2
        side = scheduler_side(address, lookup_timeout=5.0)
        try:
            req = request("lp", tokens)
            req.skip_reading_prefix_cache = True
            assert answer(side, req) == 0
            assert side.phase("lp") is Phase.RUNNING
            assert pinned(address) == 0 and side.pins_in_use == 0
            normal = request("n", tokens)
            assert answer(side, normal) == 2 * BS  # the same prompt otherwise hits
        finally:
            side.shutdown()

    await asyncio.to_thread(scenario)
