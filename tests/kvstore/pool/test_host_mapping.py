"""HostMapping: a runner maps the server's pool and sees the same bytes."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout
from kvstore.pool import HostMapping, HostPool, PoolDescriptor, PoolUnavailable, attach
from kvstore.types import SlotId

from .conftest import LAYOUT, NS

_RUNNER = """
import pickle, sys
from kvstore.pool import attach
descriptor = pickle.loads(bytes.fromhex(sys.argv[1]))
with attach(descriptor) as mapping:
    sys.stdout.write(bytes(mapping.buffer(int(sys.argv[2]))).hex())
    mapping.buffer(int(sys.argv[3]))[:] = bytes(range(256))
"""


def test_other_process_reads_and_writes_byte_exact(pool: HostPool) -> None:
    payload = os.urandom(256)
    pool.write(SlotId(9), payload)  # last slot of the short last arena
    arg = pickle.dumps(pool.descriptor).hex()
    out = subprocess.run(
        [sys.executable, "-c", _RUNNER, arg, "9", "4"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bytes.fromhex(out.stdout) == payload
    assert pool.read(SlotId(4)) == bytes(range(256))
    assert pool.read(SlotId(3)) == bytes(256)  # neighbours untouched
    assert pool.read(SlotId(5)) == bytes(256)


def test_mapping_shares_memory_both_ways(pool: HostPool) -> None:
    with attach(pool.descriptor) as mapping:
        assert isinstance(mapping, HostMapping)
        assert mapping.descriptor == pool.descriptor
        pool.write(SlotId(7), b"s" * 256)
        assert bytes(mapping.buffer(SlotId(7))) == b"s" * 256
        mapping.buffer(SlotId(8))[:] = b"r" * 256
        assert pool.read(SlotId(8)) == b"r" * 256


def test_numpy_view_is_zero_copy(pool: HostPool) -> None:
    with attach(pool.descriptor) as mapping:
        view = mapping.numpy_view(SlotId(6), LAYOUT)
        assert view.shape == LAYOUT.block_shape and view.dtype == np.float16
        assert view.flags.writeable and view.flags.c_contiguous
        view[1, 0, 2] = 1.5  # V, layer 0, token 2: every head and dim
        expected = np.zeros(LAYOUT.block_shape, np.float16)
        expected[1, 0, 2] = 1.5
        assert pool.read(SlotId(6)) == expected.tobytes()
        del view


@pytest.mark.parametrize(
    ("dtype", "numpy_dtype"),
    [("bfloat16", np.uint16), ("float8_e4m3fn", np.uint8), ("float32", np.float32)],
)
def test_numpy_view_dtypes(pool_dir: Path, dtype: str, numpy_dtype: type) -> None:
    layout = KVLayout(1, 1, 4, 2, dtype)
    with HostPool.create(NS, layout.block_bytes, 2, 5, directory=str(pool_dir)) as p:
        mapping = attach(p.descriptor)
        view = mapping.numpy_view(SlotId(1), layout)
        assert view.dtype == numpy_dtype and view.shape == layout.block_shape
        mapping.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_torch_view_is_zero_copy_with_exact_dtype(pool_dir: Path, dtype: str) -> None:
    layout = KVLayout(2, 1, 4, 2, dtype)
    with HostPool.create(NS, layout.block_bytes, 3, 6, directory=str(pool_dir)) as p:
        mapping = attach(p.descriptor)
        tensor = mapping.torch_view(SlotId(2), layout)
        assert tensor.dtype == getattr(torch, dtype)
        assert tuple(tensor.shape) == layout.block_shape
        source = torch.full(layout.block_shape, 0.5).to(tensor.dtype)
        tensor.copy_(source)
        got = torch.frombuffer(bytearray(p.read(SlotId(2))), dtype=tensor.dtype)
        assert torch.equal(got.view(layout.block_shape), source)
        mapping.close()


def test_view_with_wrong_layout(pool: HostPool) -> None:
    with attach(pool.descriptor) as mapping, pytest.raises(InvalidArgument, match="bytes"):
        mapping.numpy_view(SlotId(0), KVLayout(1, 1, 1, 1, "float16"))


def test_close_mapping_with_live_views(pool: HostPool) -> None:
    mapping = attach(pool.descriptor)
    view = mapping.numpy_view(SlotId(0), LAYOUT)
    tensor = mapping.torch_view(SlotId(1), LAYOUT)
    mapping.close()
    mapping.close()
    assert mapping.closed
    view[...] = 2.0  # still valid memory
    tensor.fill_(3.0)
    with pytest.raises(PoolUnavailable, match="closed"):
        mapping.buffer(SlotId(0))
    assert pool.read(SlotId(0)) == np.full(LAYOUT.block_shape, 2.0, np.float16).tobytes()


def test_attach_after_server_closed(pool: HostPool) -> None:
    descriptor = pool.descriptor
    pool.close()
    with pytest.raises(PoolUnavailable, match="attach the pool again"):
        attach(descriptor)


def test_attach_wrong_size(pool: HostPool) -> None:
    os.truncate(pool.descriptor.arenas[2].path, 100)
    with pytest.raises(PoolUnavailable, match="100 bytes"):
        attach(pool.descriptor)


def test_attach_refuses_symlink(pool: HostPool, pool_dir: Path) -> None:
    link = pool_dir / "link"
    link.symlink_to(pool.descriptor.arenas[0].path)
    arenas = (pool.descriptor.arenas[0].__class__(0, 1024, str(link)), *pool.descriptor.arenas[1:])
    descriptor = PoolDescriptor(
        "host",
        1,
        NS,
        256,
        10,
        4,
        arenas,  # same geometry, first arena via a symlink
    )
    with pytest.raises(PoolUnavailable, match="symbolic link"):
        attach(descriptor)


def test_cuda_pool_without_cupy_says_what_to_install(
    pool: HostPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = pool.descriptor
    cuda = PoolDescriptor("cuda", d.epoch, NS, d.block_bytes, d.capacity, 4, d.arenas, "GPU-0")
    monkeypatch.setitem(sys.modules, "cupy", None)  # as if the cuda extra were not installed
    with pytest.raises(PoolUnavailable, match=r"pip install 'kvstore\[cuda\]'"):
        attach(cuda)
