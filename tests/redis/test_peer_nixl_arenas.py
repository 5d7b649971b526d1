"""The NIXL agent follows the pools: an arena is registered when it joins its pool
and deregistered before it is given back (a shrink, a dropped namespace, shutdown).

No Redis and no second node: `PoolManager` driven directly, with a real agent.
"""

from __future__ import annotations

import pytest

from kvstore.types import NamespaceId, SlotId
from service.cluster.nixl_agent import NixlAgent, Place, coalesce
from service.config import Config
from service.memory.budget import PoolManager

pytest.importorskip("nixl._api", reason="needs the nixl package (pip install kvstore[nixl])")

BLOCK = 4096
NS = NamespaceId("0123456789abcdef")


class Recorder:
    """An ArenaWatcher in front of the agent, recording the calls in order."""

    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent
        self.calls: list[tuple[str, int]] = []

    def added(self, namespace, pool, index) -> None:
        self.calls.append(("added", index))
        self.agent.added(namespace, pool, index)

    def removing(self, namespace, index) -> None:
        self.calls.append(("removing", index))
        self.agent.removing(namespace, index)


def test_arenas_are_registered_as_the_pool_grows_and_deregistered_before_they_go(tmp_path):
    config = Config(
        port=0, metrics_port=0, shm_dir=str(tmp_path), capacity_bytes=64 * BLOCK,
        arena_bytes=8 * BLOCK, pool_prefault=False, pool_prefix="kvnixlarena",
    )  # fmt: skip
    pools = PoolManager(config)
    agent = NixlAgent.create("kvstore-arena-test")
    recorder = Recorder(agent)
    try:
        plan = pools.plan(BLOCK, 0)
        assert pools.promise(plan.arena_cost)
        pools.adopt(NS, pools.build_arena(NS, plan, pools.next_serial()), plan)
        pools.watch(recorder)  # arenas that exist already are told at once
        version = agent.metadata_version
        for _ in range(2):
            assert pools.promise(plan.arena_cost)
            pools.grow(NS, pools.build_arena(NS, plan, pools.next_serial()))
        assert recorder.calls == [("added", 0), ("added", 1), ("added", 2)]
        assert agent.metadata_version == version + 2  # peers reload the metadata
        pool = pools.get(NS)
        last = SlotId(2 * plan.slots_per_arena)
        place = agent.slot_address(NS, pool, last)
        assert place is not None and place.arena == 2

        pools.shrink(NS)  # the last arena goes: deregistered first
        assert recorder.calls[-1] == ("removing", 2)
        assert agent.slot_address(NS, pool, SlotId(plan.slots_per_arena)) is not None
        pools.discard(NS)  # a dropped namespace: every arena, last first
        assert recorder.calls[-2:] == [("removing", 1), ("removing", 0)]
        assert agent.slot_address(NS, pool, SlotId(0)) is None
    finally:
        pools.close()
        agent.close()


def test_only_blocks_adjacent_on_both_sides_and_in_one_arena_each_travel_as_one():
    local = [Place(0, 1000), Place(0, 1100), Place(1, 1200), Place(1, 1300), Place(1, 1500)]
    remote = [Place(3, 9000), Place(3, 9100), Place(3, 9200), Place(4, 9300), Place(4, 9400)]
    assert coalesce(local, remote, 100) == [
        (1000, 9000, 200),  # adjacent, same arenas
        (1200, 9200, 100),  # the local arena changed (though the memory is adjacent)
        (1300, 9300, 100),  # the remote arena changed
        (1500, 9400, 100),  # not adjacent locally
    ]
