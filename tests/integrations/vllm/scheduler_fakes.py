"""Stand-ins for vLLM's requests and scheduler steps, and a scheduler side on a real node.

Shared by the scheduler-side tests that run without vLLM (the connector reads only
the fields these plain objects carry).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from kvstore.client import SyncClient
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.node_link import NodeLink
from kvstore.integrations.vllm.scheduler import SchedulerSide
from tests.client.blocks import LAYOUT
from tests.waiting import wait_until

MODEL = "vllm:test-scheduler"
BS = LAYOUT.block_size


def request(req_id: str, tokens: list[int]) -> Any:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=tokens,
        all_token_ids=list(tokens),
        num_tokens=len(tokens),
        num_computed_tokens=0,
        prompt_embeds=None,
        lora_request=None,
        mm_features=None,
        cache_salt=None,
    )


def scheduler_side(
    address: str, models: str | list[str] = MODEL, save_decode: bool = True, **config: Any
) -> SchedulerSide:
    """A scheduler side (as vLLM's engine core makes it) on the node at ``address``."""
    link = NodeLink(
        ConnectorConfig(target=address, tenant="acme", **config),
        models,
        LAYOUT,
        client_name="test",
        map_pool=False,
    )
    return SchedulerSide(link, BS, load=True, save=True, save_decode=save_decode, extra_keys=None)


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
    tokens: int = wait_until(
        lambda: side.num_new_matched_tokens(req, 0),
        ok=lambda tokens: tokens is not None,
        within=10,
        interval=0.005,
        what="the lookup to be answered",
    )
    return tokens


def store_prompt(address: str, tokens: list[int], model: str = MODEL) -> int:
    """Store the full blocks of ``tokens`` as tenant acme; the blocks committed."""
    with SyncClient(address, tenant="acme", timeout=5.0) as c:
        ns = c.register_namespace(model, LAYOUT, timeout=5.0)
        n = len(tokens) // BS
        blocks = np.ones((n, *LAYOUT.block_shape), dtype=np.float16)
        return c.store(ns, tokens, blocks, timeout=5.0).committed


def pinned(address: str) -> int:
    with SyncClient(address, timeout=5.0) as c:
        return int(c.stats(timeout=5.0).pinned)


def prefill_step(req: Any, block_ids: list[int]) -> Any:
    """A step scheduling the whole prompt of ``req`` into ``block_ids``."""
    new = SimpleNamespace(req_id=req.request_id, block_ids=(block_ids,), num_computed_tokens=0)
    return step(num_scheduled_tokens={req.request_id: req.num_tokens}, scheduled_new_reqs=[new])
