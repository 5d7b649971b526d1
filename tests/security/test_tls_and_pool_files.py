"""TLS and mutual TLS on the gRPC port; pool file permissions."""

from __future__ import annotations

import os
import stat
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from kvstore.client import Client, TLSOptions
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.config import ConfigError, load_config
from service.server import Server
from tests.inproc import LAYOUT, ManualClock


async def _ping(channel: grpc.aio.Channel) -> None:
    await kvstore_pb2_grpc.KVStoreStub(channel).Ping(pb.PingRequest(payload=b"x"), timeout=3)


async def test_tls_server_refuses_plaintext_and_serves_tls(server_config, pki):
    config = replace(
        server_config, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key")
    )
    async with Server(config, clock=ManualClock()) as server:
        async with grpc.aio.insecure_channel(server.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _ping(ch)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        async with Client(server.address, tls_root_cert=str(pki / "ca.pem"), map_pool=False) as c:
            await c.ping()


async def test_mutual_tls_requires_a_client_certificate(server_config, pki):
    config = replace(
        server_config,
        tls_cert=str(pki / "server.pem"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.pem"),
    )
    async with Server(config, clock=ManualClock()) as server:
        no_cert = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
        async with grpc.aio.secure_channel(server.address, no_cert) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _ping(ch)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        tls = TLSOptions(
            root_cert=pki / "ca.pem", client_cert=pki / "client.pem", client_key=pki / "client.key"
        )
        async with Client(server.address, tls=tls, map_pool=False) as c:
            await c.ping()


def test_tls_config_is_checked():
    with pytest.raises(ConfigError, match="go together"):
        load_config(["--tls-cert", "a.pem"], env={})
    with pytest.raises(ConfigError, match="needs tls_cert"):
        load_config(["--tls-client-ca", "ca.pem"], env={})


@pytest.mark.parametrize("mode", ["666", "644", "604"])
def test_world_accessible_pool_mode_is_rejected(mode):
    with pytest.raises(ConfigError, match="world accessible"):
        load_config(["--pool-file-mode", mode], env={})


async def _pool_files(config) -> list[os.stat_result]:
    async with Server(config, clock=ManualClock()) as server:
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = kvstore_pb2_grpc.KVStoreStub(ch)
            await stub.RegisterNamespace(pb.RegisterNamespaceRequest(model_id="m", layout=LAYOUT))
        infos = [os.stat(p) for p in pool_paths(config.shm_dir, config.pool_prefix)]
        assert infos
        return infos


def pool_paths(directory: str, prefix: str) -> list[str]:
    """The pool files a node created (read while it runs: they go at stop)."""
    return sorted(str(p) for p in Path(directory).glob(prefix + "*"))


async def test_pool_files_are_owner_only_by_default(server_config):
    old = os.umask(0)  # a permissive umask must not widen them
    try:
        infos = await _pool_files(server_config)
    finally:
        os.umask(old)
    assert all(stat.S_IMODE(i.st_mode) == 0o600 for i in infos)


async def test_pool_file_group_gives_0660_to_that_group(server_config):
    gid = os.getgid()
    infos = await _pool_files(replace(server_config, pool_file_group=str(gid)))
    assert all(stat.S_IMODE(i.st_mode) == 0o660 and i.st_gid == gid for i in infos)
