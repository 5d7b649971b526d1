"""Three cache nodes in separate processes on a private Redis, configured like docker-compose.

Registry and expiry (a SIGKILLed node vanishes within its TTL), peer fetch
byte-exact across processes, and Redis killed and restarted under load:
local lookups keep being answered, and the directory is resynchronised.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import time

import pytest
import redis.asyncio as aioredis

from service.cluster.directory import Directory
from service.cluster.keys import Keys
from service.cluster.registry import Registry
from tests.e2e.compose_stack import load_stack, spawn, stop
from tests.redis.rpc import Rpc, block_bytes
from tests.redis.server import RedisServer, free_port
from tests.waiting import until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

KEYS = Keys("kvstore")  # the default prefix: what the compose nodes use
TTL = 1.5


class Cluster:
    def __init__(self, tmp_path) -> None:
        self.tmp_path = tmp_path
        self.redis = RedisServer(tmp_path / "redis").start()
        self.template = load_stack(tmp_path)["node-1"]
        self.procs: dict[str, object] = {}
        self.addresses: dict[str, str] = {}

    def start_node(self, node_id: str) -> str:
        port = free_port()
        address = f"127.0.0.1:{port}"
        self.procs[node_id] = spawn(
            self.template,
            self.tmp_path,
            KVSTORE_NODE_ID=node_id,
            KVSTORE_PORT=str(port),
            KVSTORE_ADVERTISE_ADDRESS=address,
            KVSTORE_METRICS_PORT="0",
            KVSTORE_REDIS_URL=self.redis.url,
            KVSTORE_HEARTBEAT_SECONDS="0.3",
            KVSTORE_NODE_TTL_SECONDS=str(TTL),
            KVSTORE_REDIS_TIMEOUT="0.5",
            KVSTORE_DIRECTORY_FLUSH_SECONDS="0.01",
            KVSTORE_DIRECTORY_QUEUE_BLOCKS="16",
        )
        self.addresses[node_id] = address
        return address

    def close(self) -> None:
        for proc in self.procs.values():
            stop(proc)  # type: ignore[arg-type]
        self.redis.stop()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


async def live(client) -> list[str]:
    try:
        return [n.node_id for n in await Registry(KEYS, 1000, 1000).live_nodes(client)]
    except Exception:
        return []


async def connected(address: str) -> Rpc:
    rpc = Rpc(address)
    deadline = time.monotonic() + 30
    while True:
        try:
            await rpc.register()
            return rpc
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def _eq(value, expected) -> bool:
    return await value == expected


async def test_three_processes_registry_sigkill_and_peer_fetch(cluster):
    rpcs = {n: await connected(cluster.start_node(n)) for n in ("n1", "n2", "n3")}
    client = aioredis.Redis.from_url(cluster.redis.url)
    try:
        await until(lambda: _eq(live(client), ["n1", "n2", "n3"]), what="3 nodes registered")
        chain = await rpcs["n1"].store(seed=11, blocks=6)
        directory = Directory(KEYS, "observer", 1000)
        await until(
            lambda: _eq(_lens(directory, client, rpcs["n1"].namespace, chain), {"n1": 6}),
            what="directory entry",
        )
        # Peer fetch across processes, byte-exact.
        assert (await rpcs["n2"].lookup(11, 6, remote=True)).hit_blocks == 6
        assert await rpcs["n2"].read(11, 6) == [block_bytes(11, i) for i in range(6)]
        await until(
            lambda: _eq(_lens(directory, client, rpcs["n1"].namespace, chain), {"n1": 6, "n2": 6}),
            what="n2 in the directory",
        )
        # SIGKILL n1: it vanishes from the registry and the directory within its TTL.
        killed = time.monotonic()
        cluster.procs["n1"].send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
        await until(lambda: _eq(live(client), ["n2", "n3"]), within=TTL + 5, what="n1 gone")
        await until(
            lambda: _eq(_lens(directory, client, rpcs["n1"].namespace, chain), {"n2": 6}),
            within=TTL + 5,
            what="n1's entries gone",
        )
        assert time.monotonic() - killed < TTL + 2
        # n3 fetches from n2 (the only live holder).
        assert (await rpcs["n3"].lookup(11, 6, remote=True)).hit_blocks == 6
        assert await rpcs["n3"].read(11, 6) == [block_bytes(11, i) for i in range(6)]
    finally:
        await client.aclose()
        for rpc in rpcs.values():
            await rpc.close()


async def _lens(directory, client, ns, chain) -> dict[str, int]:
    holders = await directory.locate(client, ns, "default", chain, skip_self=False)
    return {h.node_id: h.blocks for h in holders}


async def test_redis_restart_under_load_local_lookups_answered_and_resynced(cluster):
    rpcs = {n: await connected(cluster.start_node(n)) for n in ("n1", "n2")}
    chain = await rpcs["n1"].store(seed=21, blocks=4)
    failures: list[BaseException] = []
    answered = 0
    done = asyncio.Event()

    async def load() -> None:
        nonlocal answered
        while not done.is_set():
            try:
                assert (await rpcs["n1"].lookup(21, 4, remote=True, deadline=5)).hit_blocks == 4
                answered += 1
            except BaseException as exc:
                failures.append(exc)

    worker = asyncio.create_task(load())
    try:
        await until(lambda: answered > 10, what="load running")
        cluster.redis.kill()
        during = answered
        chain2 = await rpcs["n1"].store(seed=22, blocks=24)  # > the 16-block queue: overflow
        await until(lambda: answered > during + 50, what="lookups during the outage")
        cluster.redis.start()  # empty
        client = aioredis.Redis.from_url(cluster.redis.url)
        try:
            directory = Directory(KEYS, "observer", 1000)
            ns = rpcs["n1"].namespace
            await until(lambda: _eq(live(client), ["n1", "n2"]), what="re-registered")
            await until(
                lambda: _eq(_lens(directory, client, ns, chain2), {"n1": 24}), what="resync"
            )
            assert await _lens(directory, client, ns, chain) == {"n1": 4}
        finally:
            await client.aclose()
        assert (await rpcs["n2"].lookup(22, 24, remote=True)).hit_blocks == 24
    finally:
        done.set()
        await worker
        for rpc in rpcs.values():
            await rpc.close()
    assert failures == []
    assert answered > 60
