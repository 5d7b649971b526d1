"""A live node for the CLI and web tests, and a runner for ``kvstore`` subprocesses.

The node runs in-process on its own event loop in a thread (module scope:
one node for a module's tests), so tests stay synchronous and the commands
run as real subprocesses against it. `populate` caches a small workload with
a shared "system prompt": three requests share its 3 blocks and then diverge.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.config import Config
from service.server import Server
from tests.replies import entries_of
from tests.stand_ins import stand_in_checksums

BLOCK_SIZE = 4
LAYOUT = pb.KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=4, block_size=BLOCK_SIZE, dtype="float16"
)
ADMIN_TOKEN = "test-admin-token-0123456789"
SYSTEM = list(range(1000, 1000 + 3 * BLOCK_SIZE))
"""A 3-block system prompt that three requests share."""
REQUESTS = [SYSTEM + [n] * (2 * BLOCK_SIZE) for n in (1, 2, 3)] + [list(range(7, 7 + BLOCK_SIZE))]
"""Three requests behind the system prompt (2 own blocks each) and one unrelated 1-block one."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class LiveNode:
    """A started server in a background thread."""

    server: Server
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    target: str
    metrics_port: int
    namespace: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def stub(self) -> tuple[grpc.Channel, kvstore_pb2_grpc.KVStoreStub]:
        channel = grpc.insecure_channel(self.target)
        return channel, kvstore_pb2_grpc.KVStoreStub(channel)


def start_node(tmp_path, **overrides: Any) -> LiveNode:
    config = Config(
        host="127.0.0.1",
        port=0,
        metrics_port=free_port(),
        capacity_bytes=1 << 20,
        namespace_capacity_bytes=64 * 256,
        arena_bytes=16 * 256,
        pool_headroom_bytes=0,  # pools grow on need only: the figures count arenas
        shm_dir=str(tmp_path),
        pool_prefix=f"kvcli{uuid.uuid4().hex[:8]}",
        pool_prefault=False,
        node_id="cli-node",
        salt_secret=bytes(range(32)),
        grace_seconds=0.1,
        admin_token=ADMIN_TOKEN,
        stats_sample_seconds=0.2,
        **overrides,
    )
    loop = asyncio.new_event_loop()
    server = Server(config, expiry_tick=0.05)
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="kvstore-test-node", daemon=True)
    thread.start()
    assert started.wait(20), "the test node did not start"
    return LiveNode(server, loop, thread, server.address, server.metrics_port)


def stop_node(node: LiveNode) -> None:
    asyncio.run_coroutine_threadsafe(node.server.stop(0.1), node.loop).result(20)
    node.loop.call_soon_threadsafe(node.loop.stop)
    node.thread.join(20)
    node.loop.close()


def store_prompt(
    node: LiveNode, model: str, tokens: list[int], metadata: tuple[tuple[str, str], ...] = ()
) -> str:
    """Register ``model`` and cache ``tokens`` under a fresh lease as the caller of ``metadata``.

    Returns the namespace id.
    """
    channel, stub = node.stub()
    with channel:
        ns = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id=model, layout=LAYOUT), metadata=metadata, timeout=5
        ).namespace_id
        lid = stub.OpenLease(
            pb.OpenLeaseRequest(ttl_seconds=600), metadata=metadata, timeout=5
        ).lease_id
        res = stub.Reserve(
            pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=tokens),
            metadata=metadata,
            timeout=5,
        )
        stub.Commit(
            pb.CommitRequest(
                namespace_id=ns,
                lease_id=lid,
                packed_hashes=b"".join([e.hash for e in entries_of(res)]),
                packed_checksums=stand_in_checksums(b"".join([e.hash for e in entries_of(res)])),
            ),
            metadata=metadata,
            timeout=5,
        )
    return ns


def populate(node: LiveNode) -> str:
    """Cache `REQUESTS`, then look each up again (hits) plus one miss; returns the namespace."""
    channel, stub = node.stub()
    with channel:
        ns = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id="demo-model", layout=LAYOUT), timeout=5
        ).namespace_id
        lid = stub.OpenLease(pb.OpenLeaseRequest(ttl_seconds=600), timeout=5).lease_id
        for tokens in REQUESTS:
            res = stub.Reserve(
                pb.ReserveRequest(namespace_id=ns, lease_id=lid, tokens=tokens), timeout=5
            )
            fresh = [e.hash for e in entries_of(res) if e.status == pb.RESERVE_STATUS_RESERVED]
            stub.Commit(
                pb.CommitRequest(
                    namespace_id=ns,
                    lease_id=lid,
                    packed_hashes=b"".join(fresh),
                    packed_checksums=stand_in_checksums(b"".join(fresh)),
                ),
                timeout=5,
            )
        for tokens in REQUESTS[:3]:
            stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=tokens), timeout=5)
        stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=list(range(50, 58))), timeout=5)
        # one pinned block: the first request's blocks stay pinned by this lease
        stub.Lookup(
            pb.LookupRequest(namespace_id=ns, lease_id=lid, pin=True, tokens=REQUESTS[3]), timeout=5
        )
    node.namespace = ns
    return ns


@pytest.fixture(scope="module")
def live_node(tmp_path_factory) -> Iterator[LiveNode]:
    node = start_node(tmp_path_factory.mktemp("pools"))
    try:
        populate(node)
        yield node
    finally:
        stop_node(node)


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


def kvstore(*args: str, env: dict[str, str] | None = None, input: str | None = None,
            timeout: float = 30) -> Result:  # fmt: skip
    """Run ``python -m kvstore.cli ARGS`` (the console script's code) as a subprocess."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        input=input if input is not None else "",
        timeout=timeout,
        check=False,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)
