"""`python -m service` starts, says where it listens, and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys

import grpc

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc


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
