"""`attach`: map the pool a descriptor names with the mapping class of its kind.

Kept out of `kvstore.pool.base`: the host and CUDA mappings subclass the
classes there, so a factory in the base would import its own subclasses.
"""

from __future__ import annotations

from kvstore.pool.base import PoolDescriptor, PoolMapping, PoolUnavailable
from kvstore.pool.cuda_mapping import CudaMapping
from kvstore.pool.host import HostMapping


def attach(descriptor: PoolDescriptor, *, device: str | int | None = None) -> PoolMapping:
    """Map a pool described by the server into this process.

    Args:
        descriptor: what ``AttachPool`` returned.
        device: CUDA pools only: the runner's GPU (ordinal of this process,
            ``"cuda:N"`` or UUID) for the peer-access check; None means the
            pool's own GPU.

    Raises:
        PoolUnavailable: the pool's memory is gone or resized (the server
            restarted: ask for a new descriptor), or this process cannot
            map its kind (a CUDA pool without cupy or without the pool's GPU).
    """
    if descriptor.kind == "host":
        return HostMapping.open(descriptor)
    if descriptor.kind == "cuda":
        return CudaMapping.open(descriptor, device=device)
    raise PoolUnavailable(f"this build cannot attach pools of kind {descriptor.kind!r}")
