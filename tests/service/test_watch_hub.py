"""The in-process event fan-out: filters by namespace, drops oldest for slow watchers."""

from __future__ import annotations

import asyncio

from service.ops.watch_hub import WatchHub


async def test_fan_out_filters_and_drops_oldest():
    hub: WatchHub[str] = WatchHub(maxsize=2)
    everything = hub.subscribe()
    only_a = hub.subscribe("a")
    for item in ("a1", "b1", "a2", "a3"):
        hub.publish(item[0], item)
    hub.close()
    assert [e async for e in everything] == ["a2", "a3"]  # a slow watcher lost the oldest
    assert [e async for e in only_a] == ["a2", "a3"]
    assert everything.dropped == 2 and only_a.dropped == 1 and hub.dropped == 3
    late = hub.subscribe()
    assert await asyncio.wait_for(anext(aiter(late), None), 1) is None  # closed hub ends at once
