"""The SDK on a CUDA pool: the caller's GPU and stream, and no Release before the reads end.

A node on the fake CUDA runtime (tests/kvstore/pool/fake_cuda.py) runs in its
own thread; ``torch.cuda`` is faked per thread (`FakeTorchCuda`) as a runner
on a GPU sees it: each thread has its current device and streams, and streams
log their events, waits and synchronisations.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest
import torch

from kvstore.client import Client, SyncClient
from kvstore.layout import KVLayout
from kvstore.pool import HostPool, attach
from kvstore.types import NamespaceId
from service.server import Server
from tests.kvstore.pool.fake_cuda import FakeCudaRuntime, FakeStream, FakeTorchCuda
from tests.service.cuda_node import threaded_node

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-11111111-1111-1111-1111-111111111111"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float16")
TOKENS = list(range(12))
BLOCKS = [torch.full(LAYOUT.block_shape, float(i)).half() for i in range(3)]
MAIN = threading.current_thread().name


@pytest.fixture
def rt() -> FakeCudaRuntime:
    return FakeCudaRuntime(uuids=[UUID0, UUID1], peer={(1, 0)}, total_bytes=1 << 25)


@pytest.fixture
def node(server_config, rt) -> Iterator[Server]:
    # CUDA arenas are whole 2 MiB IPC blocks, counted so in the budget.
    config = dataclasses.replace(server_config, device="cuda:0", capacity_bytes=16 << 20)
    with threaded_node(config, rt) as server:
        yield server


@pytest.fixture
def gpu(monkeypatch) -> FakeTorchCuda:
    fake = FakeTorchCuda()
    fake.install(monkeypatch)
    return fake


def log_rpcs(client: Client, log: list[str], methods=("Commit", "Release")) -> None:
    real = client._rpc.call

    async def call(method, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        if method.name in methods:
            log.append(f"rpc:{method.name}")
        return await real(method, request, *args, **kwargs)

    client._rpc.call = call  # type: ignore[method-assign]


def before(log: list[str], first: str, then: str) -> bool:
    return first in log and then in log and log.index(first) < log.index(then)


# --- SyncClient: the caller's device and stream ------------------------------------


def test_sync_client_attaches_the_pool_for_the_callers_gpu(node, rt, gpu):
    gpu.set_device(1)  # this runner computes on GPU 1; the client's loop thread is on 0
    with SyncClient(node.address, tenant="acme", timeout=5.0) as kv:
        ns = kv.register_namespace("m", LAYOUT)
        assert ns.mapping is not None and ns.mapping.runner_device.ordinal == 1
        assert (1, 0) in rt.peers_enabled  # peer access for GPU 1, the caller's


def test_sync_client_store_copies_on_the_callers_stream_and_waits_for_it(node, gpu):
    gpu.set_device(1)
    gpu.set_stream(FakeStream("caller", 1, gpu.log))
    with SyncClient(node.address, tenant="acme", timeout=5.0) as kv:
        log_rpcs(kv.client, gpu.log)
        ns = kv.register_namespace("m", LAYOUT)
        gpu.log.clear()
        assert kv.store(ns, TOKENS, BLOCKS).committed == 3
    # Each of the 3 copies queued on the caller's stream, then the synchronise reads it.
    assert gpu.log.count("enter:caller") == 4
    assert before(gpu.log, "sync:caller", "rpc:Commit")  # and complete before Commit
    assert "sync:default1" not in gpu.log


def test_concurrent_sync_callers_keep_their_own_streams(node, gpu):
    with SyncClient(node.address, tenant="acme", timeout=5.0) as kv:
        ns = kv.register_namespace("m", LAYOUT)
        errors: list[BaseException] = []

        def runner(name: str, tokens: list[int]) -> None:
            try:
                gpu.set_stream(FakeStream(name, 0, gpu.log))
                for _ in range(5):
                    kv.store(ns, tokens, BLOCKS)
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=runner, args=(f"s{i}", [i * 100 + t for t in TOKENS]))
            for i in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors
    for i in range(3):
        assert gpu.log.count(f"enter:s{i}") == 4  # its 3 blocks copied on its stream, a sync
        assert f"sync:s{i}" in gpu.log
    assert "sync:default0" not in gpu.log


# --- release after the reads ----------------------------------------------------------


async def test_release_waits_for_the_reads_before_sending_release(node, gpu):
    reader = FakeStream("reader", 0, gpu.log)
    async with Client(node.address, tenant="acme", timeout=5.0) as kv:
        log_rpcs(kv, gpu.log)
        ns = await kv.register_namespace("m", LAYOUT)
        await kv.store(ns, TOKENS, BLOCKS)
        hit = await kv.lookup(ns, TOKENS, pin=True)
        views = hit.torch_views()  # kernels reading them are queued on `reader`
        gpu.log.clear()
        with gpu.stream(reader):
            assert await kv.release(hit) == 3
        del views
    record, wait = f"record:reader:{MAIN}", next(e for e in gpu.log if e.startswith("wait:"))
    assert before(gpu.log, record, wait) and before(gpu.log, wait, "rpc:Release")
    assert not wait.endswith(MAIN)  # waited in a worker thread: the event loop stays free


async def test_release_waits_on_the_streams_or_events_it_is_given(node, gpu):
    async with Client(node.address, tenant="acme", timeout=5.0) as kv:
        log_rpcs(kv, gpu.log)
        ns = await kv.register_namespace("m", LAYOUT)
        await kv.store(ns, TOKENS, BLOCKS)
        mine = FakeStream("mine", 0, gpu.log)
        gpu.log.clear()
        await kv.release(await kv.lookup(ns, TOKENS, pin=True), streams=[mine])
        assert [e.split(":")[:2] for e in gpu.log] == [
            ["record", "mine"],
            ["wait", "mine"],
            ["rpc", "Release"],
        ]
        event = FakeStream("evt", 0, gpu.log).record_event()
        gpu.log.clear()
        await kv.release(await kv.lookup(ns, TOKENS, pin=True), streams=[event])
        assert [e.split(":")[:2] for e in gpu.log] == [["wait", "evt"], ["rpc", "Release"]]
        gpu.log.clear()
        await kv.release(await kv.lookup(ns, TOKENS, pin=True), streams=())
        assert gpu.log == ["rpc:Release"]  # the caller said it synchronised


def test_sync_release_waits_in_the_calling_thread(node, gpu):
    gpu.set_stream(FakeStream("caller", 0, gpu.log))
    with SyncClient(node.address, tenant="acme", timeout=5.0) as kv:
        log_rpcs(kv.client, gpu.log)
        ns = kv.register_namespace("m", LAYOUT)
        kv.store(ns, TOKENS, BLOCKS)
        hit = kv.lookup(ns, TOKENS, pin=True)
        gpu.log.clear()
        assert kv.release(hit) == 3
    assert gpu.log[:3] == [f"record:caller:{MAIN}", f"wait:caller:{MAIN}", "rpc:Release"]


async def test_release_without_torch_cuda_waits_for_the_device(node, rt):
    # Reads by cupy or other libraries: no torch stream to wait on, so the whole GPU.
    async with Client(node.address, tenant="acme", timeout=5.0) as kv:
        ns = await kv.register_namespace("m", LAYOUT)
        await kv.store(ns, TOKENS, BLOCKS)
        hit = await kv.lookup(ns, TOKENS, pin=True)
        log_rpcs(kv, rt.calls)
        rt.calls.clear()
        await kv.release(hit)
    assert before(rt.calls, "synchronize:0", "rpc:Release")


async def test_cuda_pool_writers_send_no_checksums(node, gpu):
    """No device kernel for them yet (docs/cuda.md): 0, never checked."""
    async with Client(node.address, tenant="acme", timeout=5.0) as kv:
        ns = await kv.register_namespace("m", LAYOUT)
        await kv.store(ns, TOKENS, BLOCKS)
        hit = await kv.lookup(ns, TOKENS, pin=True)
        assert hit.hit_blocks == 3 and hit.checksums.tolist() == [0, 0, 0]
        assert hit.check_bytes() == []
        await kv.release(hit)


def test_host_pools_wait_for_nothing(tmp_path):
    with HostPool.create(NamespaceId("ab" * 8), 256, 2, 7, directory=str(tmp_path)) as pool:
        mapping = attach(pool.descriptor)
        assert mapping.read_fence() is None and mapping.read_fence([object()]) is None
        mapping.close()
