"""ArenaPool over CUDA arenas (fake runtime): grows, gives back, frees every arena."""

from __future__ import annotations

from kvstore.pool import CudaPool
from kvstore.pool.arenas import ArenaPool
from kvstore.types import SlotId
from tests.kvstore.pool.conftest import LAYOUT, NS
from tests.kvstore.pool.fake_cuda import FakeCudaRuntime

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
BLOCK = LAYOUT.block_bytes


def arena(rt: FakeCudaRuntime) -> CudaPool:
    return CudaPool.create(NS, BLOCK, 4, 0xE1, device="cuda:0", arena_bytes=4 * BLOCK, runtime=rt)


def test_cuda_arenas_grow_and_are_freed() -> None:
    rt = FakeCudaRuntime(uuids=[UUID0])
    pool = ArenaPool(arena(rt), version=1)
    pool.append(arena(rt), version=2)
    pool.append(arena(rt), version=3)
    d = pool.descriptor
    assert d.kind == "cuda" and d.device == UUID0 and d.capacity == 12 and d.version == 3
    assert len({a.cuda_ipc_handle for a in d.arenas}) == 3
    pool.write(SlotId(9), b"\x05" * BLOCK)
    assert pool.read(SlotId(9)) == b"\x05" * BLOCK and pool.read(SlotId(1)) == bytes(BLOCK)
    pool.pop(version=4).close()
    assert rt.calls.count("free") == 1 and pool.descriptor.capacity == 8
    pool.close()
    pool.close()
    assert rt.calls.count("free") == 3 and not rt.allocations
