"""The node's Redis connection: one factory for single Redis and Redis Cluster.

redis-py's per-command retries are turned off: the agent owns the retry loop
(`service.cluster.agent`, spaced by redis-py's own `EqualJitterBackoff`, see
`reconnect_backoff`), and a command against a Redis that is down must fail
within `redis_timeout` so that nothing waits on it. Every caller treats
`REDIS_ERRORS` as "Redis is away", never as a failed RPC.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import AbstractBackoff, EqualJitterBackoff, NoBackoff

from service.config import Config

REDIS_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.RedisError,
    redis.exceptions.RedisClusterException,
    OSError,
    TimeoutError,
)
"""What a Redis command raises when Redis is down, slow or misconfigured."""

MAX_FAILURES_COUNTED = 30
"""Failures past this add nothing to a backoff (its cap is reached long before)."""


def reconnect_backoff() -> AbstractBackoff:
    """Spacing of reconnect attempts: 50-100 ms after the first failure, doubling to 1-2 s.

    Equal jitter (half fixed, half random): nodes that lost Redis together
    spread out, yet none retries almost at once.
    """
    return EqualJitterBackoff(cap=2.0, base=0.05)


def backoff_seconds(backoff: AbstractBackoff, failures: int) -> float:
    """``backoff.compute(failures)``, with ``failures`` bounded.

    redis-py's backoffs compute ``base * 2**failures`` before capping, which
    overflows a float after about a thousand failures (half an hour of outage).
    """
    return backoff.compute(min(failures, MAX_FAILURES_COUNTED))


def connect(config: Config) -> Any:
    """A lazily connecting asyncio client of `config.redis_url` (a cluster if so configured).

    Returns ``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster``; both
    serve every command the cluster code uses (typed ``Any`` because their
    stubs differ in the generic parameters only).
    """
    common: dict[str, Any] = {
        "socket_timeout": config.redis_timeout,
        "socket_connect_timeout": config.redis_timeout,
        "decode_responses": False,
    }
    if config.redis_cluster:
        # One retry: a MOVED/ASK after a resharding is followed once.
        return aioredis.RedisCluster.from_url(
            config.redis_url, retry=Retry(NoBackoff(), 1), **common
        )
    return aioredis.Redis.from_url(config.redis_url, retry=Retry(NoBackoff(), 0), **common)


async def close(client: Any) -> None:
    """Close a client made by `connect`, whichever kind it is.

    ``RedisCluster.aclose`` does nothing while the client is marked for
    re-initialisation, which is the state right after a command failed on
    a dead master: then it would leave every node's connections open. So
    the cluster client's nodes are closed here in any case (idempotent).
    """
    await client.aclose()
    manager = getattr(client, "nodes_manager", None)
    if manager is not None:
        await manager.aclose()
        await manager.aclose("startup_nodes")


class LuaScript:
    """A Lua script sent once and then run by its SHA1 (``EVALSHA``, ``EVAL`` on ``NOSCRIPT``).

    Redis forgets scripts on restart (and each cluster master has its own
    cache), so the fallback is the normal path after a failover.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run on ``client`` with ``keys`` (all in one hash slot) and ``args``."""
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return await client.eval(self.source, len(keys), *keys, *args)
