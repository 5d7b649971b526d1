"""``uds_path``: the node also listens on a Unix-domain socket (runners on its host),
serves the whole API there, and removes the socket file when it stops."""

from __future__ import annotations

import dataclasses
import os
import socket
import stat

import grpc
import numpy as np
import pytest

from kvstore.client import Client
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.config import Config
from service.server import Server
from tests.client.blocks import LAYOUT


def exists(path: str) -> bool:
    """Whether the socket file is there (a local stat: no need to leave the loop)."""
    return os.path.exists(path)


def with_uds(config: Config, path: str) -> Config:
    return dataclasses.replace(config, uds_path=path, pool_file_mode=0o660)


async def test_the_socket_serves_the_api_and_is_removed_at_stop(server_config, tmp_path):
    path = str(tmp_path / "kv.sock")
    server = Server(with_uds(server_config, path))
    await server.start()
    try:
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            assert (await stub.Ping(pb.PingRequest(payload=b"abc"))).payload == b"abc"
        # The SDK takes a unix: target as it is: store, pinned lookup, release.
        async with Client(f"unix:{path}", tenant="acme", timeout=5.0) as kv:
            ns = await kv.register_namespace("uds", LAYOUT)
            tokens = list(range(1, 1 + 2 * LAYOUT.block_size))
            blocks = np.ones((2, LAYOUT.block_bytes), np.uint8)
            assert (await kv.store(ns, tokens, blocks)).committed == 2
            hit = await kv.lookup(ns, tokens, pin=True)
            assert hit.hit_blocks == 2 and hit.pinned
            assert await kv.release(hit) == 2
        # The TCP port still serves too.
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            assert (await stub.Ping(pb.PingRequest(payload=b"x"))).payload == b"x"
    finally:
        await server.stop(0.1)
    assert not exists(path)


async def test_a_stale_socket_file_is_replaced(server_config, tmp_path):
    path = str(tmp_path / "kv.sock")
    with socket.socket(socket.AF_UNIX) as left:  # bound, never listening: a dead node's file
        left.bind(path)
    assert exists(path)
    server = Server(with_uds(server_config, path))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            assert (await stub.Ping(pb.PingRequest(payload=b"up"))).payload == b"up"
    finally:
        await server.stop(0.1)
    assert not exists(path)


async def test_a_live_servers_socket_or_another_file_is_refused(server_config, tmp_path):
    path = str(tmp_path / "kv.sock")
    first = Server(with_uds(server_config, path))
    await first.start()
    try:
        with pytest.raises(OSError, match="another server listens"):
            await Server(with_uds(server_config, path)).start()
        assert stat.S_ISSOCK(os.stat(path).st_mode)  # the first node's socket is left alone
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            assert (await stub.Ping(pb.PingRequest(payload=b"ok"))).payload == b"ok"
    finally:
        await first.stop(0.1)
    plain = tmp_path / "plain"
    plain.write_text("not a socket")
    with pytest.raises(OSError, match="not a socket"):
        await Server(with_uds(server_config, str(plain))).start()
    assert plain.read_text() == "not a socket"
