"""Fixtures of the Redis tests: nodes wired to the private redis-server (``redis_server``,
tests/conftest.py), and a Redis Cluster of three masters with nodes and a client on it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from service.cluster import redis_link
from tests.redis.nodes import ClusterNodes, NodeFactory
from tests.redis.server import REDIS_SERVER, RedisClusterServers

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server on PATH")


@pytest.fixture
async def nodes(tmp_path, redis_server) -> AsyncIterator[NodeFactory]:
    factory = NodeFactory(tmp_path, redis_server.url)
    try:
        yield factory
    finally:
        for server in list(factory.servers):
            await factory.stop(server)


@pytest.fixture
async def rclient(redis_server) -> AsyncIterator[aioredis.Redis]:
    """A client of the private redis-server, to look at what the nodes wrote."""
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def redis_cluster(tmp_path) -> Iterator[RedisClusterServers]:
    cluster = RedisClusterServers(tmp_path / "rc").start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def cnodes(tmp_path, redis_cluster) -> AsyncIterator[ClusterNodes]:
    factory = ClusterNodes(tmp_path, redis_cluster.url)
    try:
        yield factory
    finally:
        for server in list(factory.servers):
            await factory.stop(server)


@pytest.fixture
async def rc(redis_cluster) -> AsyncIterator[aioredis.RedisCluster]:
    client = aioredis.RedisCluster.from_url(redis_cluster.url, socket_timeout=0.5)
    try:
        yield client
    finally:
        await redis_link.close(client)  # RedisCluster.aclose alone may leak (see redis_link.close)
