"""The SDK's GPU ordering and the pool's IPC isolation on a real GPU.

What the fake runtime cannot show (tests/service/test_cuda_client.py checks
the bookkeeping): ``release`` returns only once the GPU reads queued on the
caller's stream are done; `SyncClient` copies on the caller's stream, so it
stores what the caller's kernels produced; arenas are allocations of their
own, 2 MiB-aligned multiples of 2 MiB; device UUIDs agree with the driver's.

``torch.cuda._sleep`` holds a stream for about a second (far longer than an
RPC): work queued behind it is still pending when the next host call runs.
"""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from kvstore.client import Client, SyncClient
from kvstore.layout import KVLayout
from kvstore.pool import CudaPool, CupyRuntime, PoolUnavailable
from kvstore.pool.cuda import IPC_GRANULARITY
from kvstore.pool.cuda_runtime import format_uuid, uuid_from_driver
from kvstore.types import NamespaceId, SlotId

pytestmark = pytest.mark.cuda

LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
SLEEP_CYCLES = 2_000_000_000
"""About a second of GPU clock cycles."""


def test_device_uuids_agree_with_the_driver_and_torch() -> None:
    rt = CupyRuntime()
    for ordinal in range(rt.device_count()):
        uuid = rt.device_uuid(ordinal)
        raw = uuid_from_driver(ordinal)
        assert raw is not None and uuid == format_uuid(raw)
        from_torch = getattr(torch.cuda.get_device_properties(ordinal), "uuid", None)
        if from_torch is not None:
            assert uuid.removeprefix("GPU-") == str(from_torch).removeprefix("GPU-")


def test_arenas_are_whole_2mib_aligned_allocations() -> None:
    rt = CupyRuntime()
    block = LAYOUT.block_bytes  # 256 KiB: 3 slots need 768 KiB, padded to 2 MiB
    pools = [
        CudaPool.create(NamespaceId(f"{i:016x}"), block, 3, 1, device=0, runtime=rt)
        for i in range(2)
    ]
    libcuda = ctypes.CDLL("libcuda.so.1")
    ranges = []
    try:
        for pool in pools:
            d = pool.descriptor
            for spec in d.arenas:
                base = pool.slot_pointer(SlotId(spec.index * d.slots_per_arena))
                assert base % IPC_GRANULARITY == 0 and spec.size_bytes % IPC_GRANULARITY == 0
                # The driver's view: the allocation holding `base` is exactly the arena.
                start, size = ctypes.c_uint64(), ctypes.c_size_t()
                rc = libcuda.cuMemGetAddressRange_v2(
                    ctypes.byref(start), ctypes.byref(size), ctypes.c_uint64(base)
                )
                assert rc == 0 and (start.value, size.value) == (base, spec.size_bytes)
                ranges.append((base, base + spec.size_bytes))
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ranges))
    finally:
        for pool in pools:
            pool.close()


async def test_release_returns_after_the_reads_queued_on_the_given_stream(node) -> None:
    torch.cuda.init()
    async with Client(node.address, tenant="gpu-sdk", timeout=30.0) as kv:
        ns = await kv.register_namespace("gpu-sdk-model", LAYOUT)
        tokens = list(range(2 * LAYOUT.block_size))
        blocks = [torch.randn(LAYOUT.block_shape, device="cuda").to(torch.bfloat16) for _ in "ab"]
        assert (await kv.store(ns, tokens, blocks)).committed == 2
        hit = await kv.lookup(ns, tokens, pin=True)
        reader = torch.cuda.Stream()
        with torch.cuda.stream(reader):
            torch.cuda._sleep(SLEEP_CYCLES)
            copied = torch.stack(hit.torch_views())  # reads queued behind the sleep
        assert not reader.query()
        await kv.release(hit, streams=[reader])
        assert reader.query(), "Release was sent while reads of the slots were queued"
        want = torch.stack(blocks)
        assert torch.equal(copied.view(torch.uint16), want.view(torch.uint16))


async def test_release_by_default_waits_for_the_current_stream(node) -> None:
    torch.cuda.init()
    async with Client(node.address, tenant="gpu-sdk-default", timeout=30.0) as kv:
        ns = await kv.register_namespace("gpu-sdk-model", LAYOUT)
        tokens = list(range(100, 100 + LAYOUT.block_size))
        block = torch.randn(LAYOUT.block_shape, device="cuda").to(torch.bfloat16)
        assert (await kv.store(ns, tokens, [block])).committed == 1
        hit = await kv.lookup(ns, tokens, pin=True)
        reader = torch.cuda.Stream()
        with torch.cuda.stream(reader):
            torch.cuda._sleep(SLEEP_CYCLES)
            copied = hit.torch_views()[0].clone()
            await kv.release(hit)  # the current stream here is `reader`
        assert reader.query()
        assert torch.equal(copied.view(torch.uint16), block.view(torch.uint16))


def test_sync_client_copies_on_the_callers_stream(node) -> None:
    torch.cuda.init()
    with SyncClient(node.address, tenant="gpu-sdk-sync", timeout=30.0) as kv:
        ns = kv.register_namespace("gpu-sdk-model", LAYOUT)
        tokens = list(range(200, 200 + 2 * LAYOUT.block_size))
        producer = torch.cuda.Stream()
        with torch.cuda.stream(producer):
            blocks = [torch.zeros(LAYOUT.block_shape, device="cuda", dtype=torch.bfloat16)]
            blocks.append(torch.zeros_like(blocks[0]))
            torch.cuda._sleep(SLEEP_CYCLES)
            for i, b in enumerate(blocks):
                b.fill_(i + 1.0)  # complete only after the sleep, on `producer`
            assert kv.store(ns, tokens, blocks).committed == 2
        hit = kv.lookup(ns, tokens, pin=True)
        values = [float(v.float().mean()) for v in hit.torch_views()]
        kv.release(hit)
    assert values == [1.0, 2.0], "the copies did not wait for the caller's stream"


def test_sync_client_attaches_for_the_callers_gpu(node) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.cuda.set_device(1)  # the node's pool is on GPU 0; this runner computes on 1
    try:
        with SyncClient(node.address, tenant="gpu-sdk-dev", timeout=30.0) as kv:
            if not torch.cuda.can_device_access_peer(1, 0):
                with pytest.raises(PoolUnavailable, match="peer-to-peer"):
                    kv.register_namespace("gpu-sdk-model", LAYOUT)
                return
            ns = kv.register_namespace("gpu-sdk-model", LAYOUT)
            assert ns.mapping is not None
            assert ns.mapping.runner_device.ordinal == 1  # type: ignore[attr-defined]
    finally:
        torch.cuda.set_device(0)
