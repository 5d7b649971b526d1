"""In-process nodes wired to one private Redis (the ``nodes`` fixture makes a `NodeFactory`)."""

from __future__ import annotations

import uuid
from dataclasses import replace

from service.config import Config
from service.server import Server
from tests.inproc import BLOCK_BYTES


def node_config(tmp_path, redis_url: str, node_id: str, **overrides) -> Config:
    """A small, fast node config on a free port, wired to ``redis_url``."""
    base = Config(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        capacity_bytes=1 << 20,
        namespace_capacity_bytes=128 * BLOCK_BYTES,
        arena_bytes=32 * BLOCK_BYTES,
        shm_dir=str(tmp_path),
        pool_prefix=f"kvr{uuid.uuid4().hex[:8]}",
        pool_prefault=False,
        node_id=node_id,
        salt_secret=bytes(range(32)),
        grace_seconds=0.1,
        max_message_bytes=1 << 20,
        max_chain_blocks=1024,
        redis_url=redis_url,
        redis_key_prefix="kvt",
        redis_timeout=0.5,
        heartbeat_seconds=0.2,
        node_ttl_seconds=1.0,
        directory_flush_seconds=0.01,
    )
    return replace(base, **overrides)


class NodeFactory:
    """Starts in-process nodes on one Redis; stops them all at the end."""

    def __init__(self, tmp_path, redis_url: str) -> None:
        self.tmp_path = tmp_path
        self.redis_url = redis_url
        self.servers: list[Server] = []

    async def start(self, node_id: str, **overrides) -> Server:
        server = Server(
            node_config(self.tmp_path, self.redis_url, node_id, **overrides), expiry_tick=0.05
        )
        await server.start()
        self.servers.append(server)
        return server

    async def stop(self, server: Server) -> None:
        if server in self.servers:
            self.servers.remove(server)
            await server.stop(0.1)


class ClusterNodes(NodeFactory):
    """Nodes with ``redis_cluster`` on."""

    async def start(self, node_id: str, **overrides):
        return await super().start(node_id, redis_cluster=True, **overrides)
