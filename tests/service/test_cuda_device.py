"""A node with ``device = "cuda:…"``: pool selection, start-up errors, and the client
data path through a CUDA mapping, on the fake runtime (no GPU needed)."""

from __future__ import annotations

import dataclasses
import gc
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvstore.client import Client
from kvstore.layout import KVLayout
from kvstore.pool import CudaMapping, CudaPool, HostPool, set_default_runtime
from kvstore.types import NamespaceId
from service.config import ConfigError, load_config
from service.memory.budget import PoolManager
from service.server import Server
from tests.kvstore.pool.fake_cuda import FakeCudaRuntime

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-11111111-1111-1111-1111-111111111111"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float16")


@pytest.mark.parametrize(
    ("value", "want"),
    [("cpu", "cpu"), ("cuda", "cuda:0"), ("cuda:1", "cuda:1"), (UUID1, f"cuda:{UUID1}")],
)
def test_device_setting(value, want):
    assert load_config(["--device", value], env={}).device == want


def test_device_setting_rejects_garbage():
    with pytest.raises(ConfigError, match="device"):
        load_config(["--device", "tpu:0"], env={})


def test_capacity_flag_abbreviation():
    config = load_config(["--device", "cuda:0", "--capacity", "40GiB"], env={})
    assert config.capacity_bytes == 40 << 30


def test_default_is_host_pools(server_config):
    manager = PoolManager(server_config)
    assert server_config.device == "cpu" and manager.cuda_device is None
    pool = manager.build_arena(NamespaceId("ab" * 8), manager.plan(256, 4 * 256), 1)
    assert isinstance(pool, HostPool)
    pool.close()


def test_cuda_device_builds_cuda_pools_on_that_gpu(server_config):
    rt = FakeCudaRuntime(uuids=[UUID0, UUID1])
    # CUDA arenas are whole 2 MiB IPC blocks: a budget of some.
    config = dataclasses.replace(server_config, device=f"cuda:{UUID1}", capacity_bytes=16 << 20)
    manager = PoolManager(config, cuda_runtime=rt)
    assert manager.cuda_device is not None and manager.cuda_device.ordinal == 1
    assert manager.cleanup() == []
    plan = manager.plan(256, 40 * 256)  # one arena here (arena_bytes is 16 blocks)
    assert manager.promise(plan.arena_cost)
    pool = manager.build_arena(NamespaceId("ab" * 8), plan, 1)
    assert isinstance(pool, CudaPool) and pool.descriptor.device == UUID1
    manager.adopt(NamespaceId("ab" * 8), pool, plan)
    # A CUDA arena is a whole 2 MiB IPC block (kvstore.pool.cuda.ipc_size), and the
    # budget counts it so: the padding is memory no other namespace can have.
    assert plan.arena_bytes == 16 * 256 and plan.arena_cost == 2 << 20
    assert manager.allocated_bytes == 2 << 20 and manager.free_bytes == (16 << 20) - (2 << 20)
    assert plan.max_arenas == 1  # the 10 KiB ceiling holds no second 2 MiB block
    manager.close()
    assert not rt.allocations


def test_missing_gpu_is_a_config_error(server_config):
    rt = FakeCudaRuntime(uuids=[UUID0])
    config = dataclasses.replace(server_config, device="cuda:3")
    with pytest.raises(ConfigError, match="device cuda:3: GPU ordinal 3"):
        PoolManager(config, cuda_runtime=rt)


def test_server_without_cupy_exits_2_with_one_line(tmp_path):
    # A child process: its own sys.modules, where cupy cannot be imported.
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "from service.server import main\n"
        f"main(['--device', 'cuda:0', '--port', '0', '--metrics-port', '0', "
        f"'--shm-dir', {str(tmp_path)!r}])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("kvstore-server:")]
    assert len(lines) == 1 and "pip install 'kvstore[cuda]'" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


async def test_client_stores_and_reads_through_a_cuda_mapping(server_config):
    rt = FakeCudaRuntime(uuids=[UUID0], total_bytes=1 << 24)
    set_default_runtime(rt)
    try:
        config = dataclasses.replace(server_config, device="cuda:0", capacity_bytes=8 << 20)
        server = Server(config, expiry_tick=0.02)
        await server.start()
        try:
            async with Client(server.address, tenant="acme", timeout=5.0) as kv:
                ns = await kv.register_namespace("m", LAYOUT)
                assert isinstance(ns.mapping, CudaMapping)
                assert ns.mapping.descriptor.device == UUID0
                tokens = list(range(12))
                blocks = [torch.randn(LAYOUT.block_shape).half() for _ in range(3)]
                rt.calls.clear()
                stored = await kv.store(ns, tokens, blocks)
                assert stored.committed == 3
                assert "synchronize:0" in rt.calls  # waited before Commit
                hit = await kv.lookup(ns, tokens, pin=True)
                views = hit.torch_views()
                assert len(views) == 3
                for view, block in zip(views, blocks, strict=True):
                    assert torch.equal(view, block)
                got = await kv.read_blocks(hit)  # gRPC path: the server's device read
                assert got[1] == blocks[1].numpy().tobytes()
                del views, view
                await kv.release(hit)
                # bytes and numpy sources work too
                more = list(range(12, 20))
                raw = [np.full(LAYOUT.block_shape, 2, np.float16), bytes(LAYOUT.block_bytes)]
                assert (await kv.store(ns, tokens + more, [*blocks, *raw])).committed == 2
        finally:
            await server.stop(0.1)
    finally:
        set_default_runtime(None)
    gc.collect()
    assert rt.open_count() == 0  # closing the client closed its handles
