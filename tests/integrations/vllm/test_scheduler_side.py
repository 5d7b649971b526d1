"""The connector's scheduler side against a real in-process node, without vLLM.

vLLM's requests and scheduler outputs are stood in for by plain objects with
the fields the connector reads; the node, the client and its lease are real.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvstore.client import SyncClient
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.link import NodeLink
from kvstore.integrations.vllm.metadata import KVStoreWorkerReport
from kvstore.integrations.vllm.scheduler import SchedulerSide
from service.server import Server
from tests.client.conftest import LAYOUT
from tests.service.conftest import clock, kv_server, server_config  # noqa: F401

MODEL = "vllm:test-scheduler"
BS = LAYOUT.block_size


def request(req_id: str, tokens: list[int]) -> Any:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=tokens,
        num_tokens=len(tokens),
        prompt_embeds=None,
        lora_request=None,
        mm_features=None,
        cache_salt=None,
    )


def step(**fields: Any) -> Any:
    """A scheduler output that schedules nothing (loads are sent whatever is scheduled)."""
    cached = SimpleNamespace(
        req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
    )
    base = {
        "preempted_req_ids": set(),
        "num_scheduled_tokens": {},
        "scheduled_new_reqs": [],
        "scheduled_cached_reqs": cached,
    }
    return SimpleNamespace(**(base | fields))


def answer(side: SchedulerSide, req: Any) -> int:
    """Ask as vLLM does, step after step, until the lookup is answered (bounded)."""
    deadline = time.monotonic() + 10
    while (tokens := side.num_new_matched_tokens(req, 0)) is None:
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.005)
    return tokens


def store_prompt(address: str, tokens: list[int]) -> int:
    """Store the full blocks of ``tokens`` as tenant acme; the blocks committed."""
    with SyncClient(address, tenant="acme", timeout=5.0) as c:
        ns = c.register_namespace(MODEL, LAYOUT, timeout=5.0)
        n = len(tokens) // BS
        blocks = np.ones((n, *LAYOUT.block_shape), dtype=np.float16)
        return c.store(ns, tokens, blocks, timeout=5.0).committed


def pinned(address: str) -> int:
    with SyncClient(address, timeout=5.0) as c:
        return int(c.stats(timeout=5.0).pinned)


async def test_pins_of_a_sent_load_outlive_the_request_until_the_worker_reports(
    kv_server: Server,  # noqa: F811
) -> None:
    address = kv_server.address

    def scenario() -> None:
        tokens = [*range(3, 3 + 3 * BS), 7]
        assert store_prompt(address, tokens) == 3
        config = ConnectorConfig(target=address, tenant="acme", lookup_timeout=5.0)
        link = NodeLink(config, MODEL, LAYOUT, client_name="test", map_pool=False)
        side = SchedulerSide(link, BS, load=True, save=True, extra_keys=None)
        try:
            req = request("r1", tokens)
            assert answer(side, req) == 3 * BS
            assert pinned(address) == 3
            side.after_alloc(req, [10, 11, 12, 13], 3 * BS)
            meta = side.build_meta(step())
            (load,) = meta.loads
            assert load.block_ids == (10, 11, 12)
            assert time.monotonic() < load.pins_until  # the worker may copy until then
            # vLLM schedules a step ahead: the request ends while its copy is queued.
            side.request_finished("r1")
            side.build_meta(step())
            assert pinned(address) == 3, "pins dropped while the worker may still copy"
            side.on_worker_output(
                SimpleNamespace(kv_connector_worker_meta=KVStoreWorkerReport(loaded={"r1"}))
            )
            deadline = time.monotonic() + 10
            while pinned(address) and time.monotonic() < deadline:
                time.sleep(0.02)  # the Release goes out in the background
            assert pinned(address) == 0
            assert side.pins_in_use == 0
        finally:
            side.shutdown()

    await asyncio.to_thread(scenario)


async def test_a_hit_vllm_does_not_take_is_released_and_never_loaded(
    kv_server: Server,  # noqa: F811
) -> None:
    address = kv_server.address

    def scenario() -> None:
        tokens = [*range(100, 100 + 2 * BS), 5]
        assert store_prompt(address, tokens) == 2
        link = NodeLink(
            ConnectorConfig(target=address, tenant="acme"), MODEL, LAYOUT, client_name="t"
        )
        link.map_pool = False
        side = SchedulerSide(link, BS, load=True, save=True, extra_keys=None)
        try:
            req = request("r2", tokens)
            assert answer(side, req) == 2 * BS
            side.after_alloc(req, [1, 2, 3], 0)  # vLLM dropped the hit
            assert side.build_meta(step()).loads == []
            deadline = time.monotonic() + 10
            while pinned(address) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert pinned(address) == 0
        finally:
            side.shutdown()

    await asyncio.to_thread(scenario)
