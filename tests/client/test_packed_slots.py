"""The SDK asks for ``packed_slots`` and reads either reply form (an older node
answers the repeated slots and generations)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvstore.client import Client
from tests.client.blocks import stored_chains


async def test_a_node_that_answers_the_repeated_fields_gives_the_same_hit(
    kv: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, prompts = await stored_chains(kv, 1)
    sent: list[Any] = []
    call = kv._rpc.call

    async def record(method: str, request: Any, *args: Any, **kw: Any) -> Any:
        sent.append(request)
        return await call(method, request, *args, **kw)

    monkeypatch.setattr(kv._rpc, "call", record)
    packed = await kv.lookup(ns, prompts[0])
    assert sent[-1].packed_slots and sent[-1].packed_reply

    async def old_node(method: str, request: Any, *args: Any, **kw: Any) -> Any:
        if method == "Lookup":
            request.packed_slots = False  # a node that predates the field ignores it
        return await call(method, request, *args, **kw)

    monkeypatch.setattr(kv._rpc, "call", old_node)
    repeated = await kv.lookup(ns, prompts[0])
    assert packed.hit_blocks == repeated.hit_blocks == 3
    assert np.array_equal(packed.slots, repeated.slots)
    assert np.array_equal(packed.generations, repeated.generations)
    assert packed.slots.dtype == repeated.slots.dtype == np.uint64
    assert packed.blocks == repeated.blocks
