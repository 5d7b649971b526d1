"""Memory pools: the only code in kvstore that touches shared or device memory.

The server creates a `BlockPool` per namespace (`HostPool` on shared-memory
files, `CudaPool` in GPU memory) and sends its `PoolDescriptor` to runners, which
`attach` it once and get zero-copy views of slots.
"""

from __future__ import annotations

from kvstore.pool.base import (
    ArenaSpec,
    BlockPool,
    PoolDescriptor,
    PoolMapping,
    PoolUnavailable,
)
from kvstore.pool.cuda import CudaDevice, CudaPool, find_device, parse_device
from kvstore.pool.cuda_caller import CallerCuda, current_torch_device
from kvstore.pool.cuda_mapping import CudaMapping, open_handles
from kvstore.pool.cuda_runtime import (
    CudaCallFailed,
    CudaRuntime,
    CupyRuntime,
    default_runtime,
    set_default_runtime,
)
from kvstore.pool.factory import attach
from kvstore.pool.host import HostMapping, HostPool, arena_file_name, cleanup_stale
from kvstore.pool.views import NUMPY_DTYPES, numpy_block_view, torch_block_view, torch_dtype

__all__ = [
    "NUMPY_DTYPES",
    "ArenaSpec",
    "BlockPool",
    "CallerCuda",
    "CudaCallFailed",
    "CudaDevice",
    "CudaMapping",
    "CudaPool",
    "CudaRuntime",
    "CupyRuntime",
    "HostMapping",
    "HostPool",
    "PoolDescriptor",
    "PoolMapping",
    "PoolUnavailable",
    "arena_file_name",
    "attach",
    "cleanup_stale",
    "current_torch_device",
    "default_runtime",
    "find_device",
    "open_handles",
    "parse_device",
    "set_default_runtime",
    "numpy_block_view",
    "torch_block_view",
    "torch_dtype",
]
