"""`python -m service` starts, says where it listens, and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import socket
import sys
from dataclasses import replace

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.config import default_node_id
from service.server import Server


async def test_process_serves_and_stops_on_sigterm(tmp_path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "service", "--port", "0", "--metrics-port", "0",
        "--shm-dir", str(tmp_path), "--pool-prefault", "false", "--grace-seconds", "0.5",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("kvstore-server listening on 127.0.0.1:"), line
        address = line.split()[-1]
        async with grpc.aio.insecure_channel(address) as ch:
            stub = kvstore_pb2_grpc.KVStoreStub(ch)
            reg = await stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(
                    model_id="m",
                    layout=pb.KVLayout(
                        num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float16"
                    ),
                    capacity_bytes=1 << 16,
                ),
                timeout=10,
            )
            assert reg.capacity_blocks == (1 << 16) // 128
        assert any(tmp_path.iterdir())
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert not any(tmp_path.iterdir()), "pool files must be unlinked on shutdown"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_bad_config_exits_with_a_clear_error():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "service", "--port", "nope",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"port (flag --port): expected an integer" in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _run_node(tmp_path, *args: str) -> tuple[int | None, str]:
    """Start `python -m service` with ``args``; (exit code or None if it kept running, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "service", "--shm-dir", str(tmp_path), "--pool-prefault", "false",
        "--pool-prefix", "second", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    except TimeoutError:
        proc.kill()
        _, err = await proc.communicate()
        return None, err.decode()
    return proc.returncode, err.decode()


async def test_a_second_node_on_a_taken_grpc_port_refuses_to_start(kv_server, tmp_path):
    # gRPC binds with SO_REUSEPORT by default: the second node would "listen" too
    # and take half the connections.
    code, err = await _run_node(tmp_path, "--port", str(kv_server.port), "--metrics-port", "0")
    assert code == 1, err
    # One line of its own (#34): no gRPC C-core "add_port.cc" line, no log of a
    # node "stopped" that never started, no traceback.
    port = kv_server.port
    assert err.splitlines() == [
        f"kvstore-server: cannot bind the gRPC server to 127.0.0.1:{port}: port {port} is in use"
        " (another kvstore-server?); choose another --port"
    ], err


async def test_a_server_that_cannot_bind_never_logs_that_it_stopped(kv_server, caplog):
    server = Server(replace(kv_server.config, port=kv_server.port, node_id="second"))
    caplog.set_level(logging.INFO, logger="service.server")
    with pytest.raises(OSError, match=f"port {kv_server.port} is in use"):
        await server.start()
    assert not [r for r in caplog.records if "stopped" in r.getMessage()], caplog.text


async def test_an_unknown_flag_is_one_line_and_a_hint():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "service", "--prot", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and out == b""
    assert err.decode().splitlines() == [
        "kvstore-server: unrecognized arguments: --prot 1 (see kvstore-server --help)"
    ]


async def test_port_0_names_the_node_after_the_port_it_bound(server_config):
    server = Server(replace(server_config, node_id=""))
    await server.start()
    try:
        assert server.port > 0
        assert server.node.node_id == default_node_id(server.port) == server.config.node_id
        assert server.node.node_id.endswith(f"-{server.port}")
        assert server.node.stats_response().node_id == server.node.node_id
    finally:
        await server.stop(0.1)
    named = Server(server_config)  # a node_id given is kept
    await named.start()
    try:
        assert named.node.node_id == server_config.node_id
    finally:
        await named.stop(0.1)


async def test_a_taken_metrics_port_is_a_clear_error_not_a_traceback(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = await _run_node(tmp_path, "--port", "0", "--metrics-port", str(port))
    assert code == 1, err
    assert f"cannot serve metrics on 127.0.0.1:{port}" in err, err
    assert "Traceback" not in err and "never awaited" not in err, err


async def test_port_0_prints_the_bound_ports_in_stable_lines(tmp_path):
    metrics_port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "service", "--port", "0", "--metrics-port", str(metrics_port),
        "--shm-dir", str(tmp_path), "--pool-prefault", "false",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        first = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().rstrip("\n")
        second = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().rstrip("\n")
        match = re.fullmatch(r"kvstore-server listening on 127\.0\.0\.1:(\d+)", first)
        assert match and int(match[1]) > 0, first
        assert second == f"kvstore-server metrics on http://127.0.0.1:{metrics_port}/metrics"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{match[1]}") as ch:
            pong = await kvstore_pb2_grpc.KVStoreStub(ch).Ping(
                pb.PingRequest(payload=b"x"), timeout=10
            )
            assert pong.payload == b"x"
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
