"""CUDA pool bookkeeping on a fake runtime: no GPU, no cupy needed."""

from __future__ import annotations

import gc
import mmap
import sys

import pytest
import torch

from kvstore.checksum import block_checksum
from kvstore.errors import InvalidArgument, LimitExceeded
from kvstore.layout import KVLayout
from kvstore.pool import (
    ArenaSpec,
    CudaMapping,
    CudaPool,
    PoolDescriptor,
    PoolUnavailable,
    attach,
    find_device,
    open_handles,
    parse_device,
    set_default_runtime,
)
from kvstore.pool.cuda_runtime import CupyRuntime
from kvstore.types import NamespaceId, SlotId
from tests.kvstore.pool.conftest import LAYOUT, NS
from tests.kvstore.pool.fake_cuda import FakeCudaRuntime

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-11111111-1111-1111-1111-111111111111"
BLOCK = LAYOUT.block_bytes


@pytest.fixture
def rt() -> FakeCudaRuntime:
    return FakeCudaRuntime(uuids=[UUID0, UUID1])


def make_pool(rt: FakeCudaRuntime, *, capacity: int = 10, epoch: int = 0xE1, device="cuda:0"):
    # 4 slots per arena: arenas of 4, 4 and 2 slots.
    return CudaPool.create(
        NS, BLOCK, capacity, epoch, device=device, arena_bytes=4 * BLOCK + 10, runtime=rt
    )


def test_arenas_are_allocated_zeroed_and_exported_once_each(rt):
    pool = make_pool(rt)
    d = pool.descriptor
    assert d.kind == "cuda" and d.device == UUID0 and d.slots_per_arena == 4
    assert [a.size_bytes for a in d.arenas] == [2 << 20] * 3  # padded to the IPC granularity
    assert [d.slots_in_arena(i) for i in range(3)] == [4, 4, 2]
    assert all(len(a.cuda_ipc_handle) == 64 for a in d.arenas)
    assert len({a.cuda_ipc_handle for a in d.arenas}) == 3
    assert rt.calls.count("malloc") == 3 and rt.calls.count("ipc_get_handle") == 3
    assert all(pool.read(SlotId(s)) == bytes(BLOCK) for s in range(10))
    pool.close()
    pool.close()
    assert rt.calls.count("free") == 3 and not rt.allocations


def test_device_by_uuid_case_insensitive(rt):
    pool = make_pool(rt, device=UUID1.lower())
    assert pool.descriptor.device == UUID1
    assert pool.device.ordinal == 1
    assert rt.current == 0  # the thread's device is restored
    pool.close()


def test_unknown_uuid_is_a_clear_error(rt):
    with pytest.raises(PoolUnavailable, match=r"GPU-dead.*not visible"):
        make_pool(rt, device="cuda:GPU-dead")
    with pytest.raises(PoolUnavailable, match="ordinal 7"):
        make_pool(rt, device="cuda:7")


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("cuda", 0),
        ("cuda:3", 3),
        ("cuda:GPU-ab", "GPU-ab"),
        ("GPU-ab", "GPU-ab"),
        ("MIG-x", "MIG-x"),
    ],
)
def test_parse_device(spec, want):
    assert parse_device(spec) == want


@pytest.mark.parametrize("spec", ["cpu", "cuda:", "gpu0", "cuda:-1"])
def test_parse_device_rejects(spec):
    with pytest.raises(InvalidArgument):
        parse_device(spec)


def test_server_read_write_round_trip_and_checks(rt):
    pool = make_pool(rt)
    data = bytes(range(256)) * (BLOCK // 256)
    pool.write(SlotId(5), data)
    assert pool.read(SlotId(5)) == data
    assert rt.calls[-2:] == ["memcpy", "memcpy"] or "synchronize:0" in rt.calls
    assert "synchronize:0" in rt.calls  # a server write waits before it can be committed
    with pytest.raises(InvalidArgument, match="bytes"):
        pool.write(SlotId(0), b"short")
    with pytest.raises(InvalidArgument, match="out of range"):
        pool.read(SlotId(10))
    with pytest.raises(InvalidArgument, match="GPU memory"):
        pool.view(SlotId(0))
    pool.close()
    with pytest.raises(PoolUnavailable, match="closed"):
        pool.read(SlotId(0))


def test_read_into_copies_a_slot_straight_into_a_host_buffer(rt):
    """One device-to-host copy into the caller's buffer (the disk tier's write buffer)."""
    pool = make_pool(rt)
    data = bytes(range(256)) * (BLOCK // 256)
    pool.write(SlotId(5), data)
    page = mmap.mmap(-1, 4096 + BLOCK)
    calls = len(rt.calls)
    pool.read_into(SlotId(5), memoryview(page)[4096:])
    assert rt.calls[calls:] == ["memcpy"] and page[4096:] == data and page[:4096] == bytes(4096)
    with pytest.raises(InvalidArgument, match="bytes"):
        pool.read_into(SlotId(5), memoryview(bytearray(BLOCK - 1)))
    pool.close()
    with pytest.raises(PoolUnavailable, match="closed"):
        pool.read_into(SlotId(0), memoryview(bytearray(BLOCK)))


def test_a_slots_checksum_is_of_its_bytes_copied_to_the_host(rt):
    """No device kernel: the checksum of a CUDA slot hashes a host copy (peer fetches)."""
    pool = make_pool(rt)
    data = bytes(range(256)) * (BLOCK // 256)
    pool.write(SlotId(3), data)
    assert pool.checksum(SlotId(3)) == block_checksum(data)
    assert pool.checksum(SlotId(4)) == block_checksum(bytes(BLOCK))
    pool.close()


def test_capacity_beyond_free_memory_is_limit_exceeded(rt):
    rt.total_bytes = 8 * BLOCK
    with pytest.raises(LimitExceeded, match="no room"):
        make_pool(rt)
    assert not rt.allocations


def test_failed_allocation_frees_what_was_allocated(rt):
    real_malloc = rt.malloc
    calls = []

    def failing(nbytes):
        calls.append(nbytes)
        if len(calls) == 2:
            from kvstore.pool.cuda_runtime import ERROR_MEMORY_ALLOCATION, CudaCallFailed

            raise CudaCallFailed("malloc", ERROR_MEMORY_ALLOCATION, "out of memory")
        return real_malloc(nbytes)

    rt.malloc = failing  # type: ignore[method-assign]
    with pytest.raises(LimitExceeded, match="out of memory"):
        make_pool(rt)
    assert not rt.allocations


def test_mapping_shares_bytes_with_pool_and_opens_each_handle_once(rt):
    pool = make_pool(rt)
    before = open_handles()
    a = CudaMapping.open(pool.descriptor, runtime=rt)
    b = CudaMapping.open(pool.descriptor, runtime=rt)  # e.g. a second client in the process
    assert rt.calls.count("ipc_open") == 3  # not 6: cached per process
    assert open_handles() == before + 3
    view = a.torch_view(SlotId(6), LAYOUT)
    assert view.shape == LAYOUT.block_shape and view.dtype == torch.float16
    view.fill_(1.5)
    assert (
        pool.read(SlotId(6))
        == torch.full(LAYOUT.block_shape, 1.5, dtype=torch.float16).numpy().tobytes()
    )
    pool.write(SlotId(7), bytes([7]) * BLOCK)
    assert bytes(b.slot_tensor(SlotId(7)).numpy()) == bytes([7]) * BLOCK
    del view
    a.close()
    assert rt.open_count() == 3  # b still uses them
    b.close()
    b.close()
    gc.collect()
    assert rt.open_count() == 0 and rt.calls.count("ipc_close") == 3
    assert open_handles() == before
    pool.close()


def test_bfloat16_views_are_exact(rt):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="bfloat16")
    pool = make_pool(rt)
    with CudaMapping.open(pool.descriptor, runtime=rt) as m:
        v = m.torch_view(SlotId(0), layout)
        assert v.dtype == torch.bfloat16
        src = torch.randn(layout.block_shape).to(torch.bfloat16)
        v.copy_(src)
        assert pool.read(SlotId(0)) == src.view(torch.uint8).numpy().tobytes()
        del v
    pool.close()


def test_views_keep_the_handle_open_after_close(rt):
    pool = make_pool(rt)
    m = CudaMapping.open(pool.descriptor, runtime=rt)
    view = m.torch_view(SlotId(0), LAYOUT)
    m.close()
    assert rt.open_count() == 1  # the arena of slot 0 stays open for the live view
    with pytest.raises(PoolUnavailable, match="closed"):
        m.torch_view(SlotId(0), LAYOUT)
    view.fill_(0)  # still valid memory
    del view
    gc.collect()
    assert rt.open_count() == 0
    pool.close()


def test_host_buffers_are_refused_with_a_hint(rt):
    pool = make_pool(rt)
    with CudaMapping.open(pool.descriptor, runtime=rt) as m:
        with pytest.raises(InvalidArgument, match="torch_view"):
            m.buffer(SlotId(0))
        with pytest.raises(InvalidArgument, match="torch_view"):
            m.numpy_view(SlotId(0), LAYOUT)
    pool.close()


def test_epoch_change_invalidates_old_handles(rt):
    old = make_pool(rt, epoch=1)
    m = CudaMapping.open(old.descriptor, runtime=rt)
    old_descriptor = old.descriptor
    with rt.exporter_exiting():
        old.close()  # the node restarts ...
    new = make_pool(rt, epoch=2)
    # ... the client drops the old mapping on the epoch change and attaches the new pool
    m.close()
    gc.collect()
    assert rt.open_count() == 0
    with pytest.raises(PoolUnavailable, match="restarted"):
        CudaMapping.open(old_descriptor, runtime=rt)
    assert rt.open_count() == 0  # a failed open leaves nothing open
    m2 = CudaMapping.open(new.descriptor, runtime=rt)
    assert {k[0] for k in _cache_keys()} == {2}  # nothing of epoch 1 is reused
    m2.close()
    new.close()


def _cache_keys():
    from kvstore.pool import cuda_mapping

    return list(cuda_mapping._CACHE.entries)


def test_runner_on_another_gpu_gets_peer_access(rt):
    rt.peer = {(1, 0)}
    pool = make_pool(rt)
    m = CudaMapping.open(pool.descriptor, device="cuda:1", runtime=rt)
    assert (1, 0) in rt.peers_enabled
    assert m.device.uuid == UUID0 and m.runner_device.uuid == UUID1
    assert rt.current == 0
    m.close()
    pool.close()


def test_runner_on_a_gpu_without_peer_access_is_a_clear_error(rt):
    pool = make_pool(rt)
    with pytest.raises(PoolUnavailable, match="peer-to-peer"):
        CudaMapping.open(pool.descriptor, device=UUID1, runtime=rt)
    assert rt.open_count() == 0
    pool.close()


def test_pool_gpu_not_visible_to_runner(rt):
    pool = make_pool(rt, device=1)
    runner_rt = FakeCudaRuntime(uuids=[UUID0])  # CUDA_VISIBLE_DEVICES=0 in the runner
    with pytest.raises(PoolUnavailable, match=r"not visible.*CUDA_VISIBLE_DEVICES"):
        CudaMapping.open(pool.descriptor, runtime=runner_rt)
    pool.close()


def test_malformed_handle_is_invalid_argument(rt):
    pool = make_pool(rt, capacity=2)
    d = pool.descriptor
    bad = PoolDescriptor(
        kind="cuda",
        epoch=d.epoch,
        namespace=d.namespace,
        block_bytes=d.block_bytes,
        capacity=d.capacity,
        slots_per_arena=d.slots_per_arena,
        arenas=(ArenaSpec(index=0, size_bytes=d.arenas[0].size_bytes, cuda_ipc_handle=b"x"),),
        device=d.device,
    )
    with pytest.raises(InvalidArgument, match="64"):
        CudaMapping.open(bad, runtime=rt)
    pool.close()


def test_synchronize_waits_on_the_pool_device_without_torch_cuda(rt):
    pool = make_pool(rt, device=1)
    with CudaMapping.open(pool.descriptor, runtime=rt) as m:
        rt.calls.clear()
        m.synchronize()
        assert rt.calls == ["synchronize:1"]
    pool.close()


def test_attach_dispatches_to_the_default_runtime(rt):
    pool = make_pool(rt)
    set_default_runtime(rt)
    try:
        m = attach(pool.descriptor)
        assert isinstance(m, CudaMapping)
        m.close()
    finally:
        set_default_runtime(None)
    pool.close()


def test_without_cupy_attach_says_what_to_install(rt, monkeypatch):
    pool = make_pool(rt)
    set_default_runtime(None)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(PoolUnavailable, match=r"pip install 'kvstore\[cuda\]'"):
        attach(pool.descriptor)
    with pytest.raises(PoolUnavailable, match="cupy"):
        CupyRuntime()
    pool.close()


def test_find_device(rt):
    assert find_device(rt, UUID1).ordinal == 1
    assert find_device(rt, 0).uuid == UUID0


def test_a_namespaces_handles_never_reach_another_namespaces_memory(rt):
    # Small pools: unpadded, cudaMalloc carves both out of one 2 MiB block, and a
    # handle of either exports that block, the other namespace's slots included.
    a = CudaPool.create(NamespaceId("aa" * 8), BLOCK, 3, 0xE1, runtime=rt)
    b = CudaPool.create(NamespaceId("bb" * 8), BLOCK, 3, 0xE1, runtime=rt)
    for mine, other in ((a, b), (b, a)):
        for spec in mine.descriptor.arenas:
            start, size = rt.reachable(spec.cuda_ipc_handle)
            assert size == spec.size_bytes and size % (2 << 20) == 0 and start % (2 << 20) == 0
            for slot in range(other.descriptor.capacity):
                ptr = other.slot_pointer(SlotId(slot))
                assert not start <= ptr < start + size, "another namespace's slot is exposed"
    a.close()
    b.close()
    assert not rt.allocations and not rt.blocks


def test_ipc_size_rounds_up_to_2_mib():
    from kvstore.pool.cuda import ipc_size

    assert [ipc_size(n) for n in (1, 2 << 20, (2 << 20) + 1, 1 << 30)] == [
        2 << 20,
        2 << 20,
        4 << 20,
        1 << 30,
    ]


def test_an_unaligned_allocation_is_refused(rt):
    real_malloc, real_free = rt.malloc, rt.free
    rt.malloc = lambda nbytes: real_malloc(nbytes) + 256  # type: ignore[method-assign]
    rt.free = lambda ptr: real_free(ptr - 256)  # type: ignore[method-assign]
    with pytest.raises(PoolUnavailable, match="not aligned"):
        make_pool(rt)
    assert not rt.allocations  # what was allocated is freed
