"""The node's memory budget, carved into one pool per namespace on the node's device.

`PoolManager` creates a pool when a namespace is registered (a `HostPool`
for ``device = "cpu"``, a `CudaPool` on the configured GPU otherwise), sized
``min(requested or the default share, what is left of the budget)`` rounded
down to whole blocks, and closes (unlinks) every pool on shutdown. Pool
files of dead servers are removed at start (`cleanup_stale`). The epoch is
random per server start, so a runner can tell a restarted node's pools from
the ones it mapped before.

A CUDA node checks its GPU when the manager is built (at server start): no
cupy, no GPU or not that GPU is a `ConfigError` naming the device, which the
server reports in one line with exit code 2. One node serves one GPU; run a
node per GPU (see docs/cuda.md).
"""

from __future__ import annotations

import grp
import logging
import secrets

from kvstore.errors import InvalidArgument
from kvstore.pool.base import BlockPool, PoolUnavailable
from kvstore.pool.cuda import CudaDevice, CudaPool, find_device
from kvstore.pool.cuda_runtime import CudaRuntime, default_runtime
from kvstore.pool.host import HostPool, cleanup_stale
from kvstore.types import NamespaceId
from service.api.errors import ResourceExhausted
from service.config import Config, ConfigError

log = logging.getLogger(__name__)


def new_epoch() -> int:
    """A random nonzero 63-bit pool epoch."""
    return secrets.randbits(63) or 1


class PoolManager:
    """Owns every namespace pool of the node and the memory budget they share."""

    def __init__(
        self, config: Config, epoch: int | None = None, cuda_runtime: CudaRuntime | None = None
    ) -> None:
        """Check the device and start with no pools.

        Args:
            config: the node's configuration (``device``, budget, arena size).
            epoch: the pool epoch; random when None.
            cuda_runtime: the CUDA runtime for a GPU device (default: cupy's).

        Raises:
            ConfigError: ``device`` names a GPU this process cannot use.
        """
        self.config = config
        self.epoch = epoch if epoch is not None else new_epoch()
        self.capacity_bytes = config.capacity_bytes
        self._pools: dict[NamespaceId, BlockPool] = {}
        self.cuda_runtime: CudaRuntime | None = None
        self.cuda_device: CudaDevice | None = None
        """The GPU of the pools; None for host pools."""
        if config.device != "cpu":
            self.cuda_runtime, self.cuda_device = _open_device(config, cuda_runtime)

    def cleanup(self) -> list[str]:
        """Remove pool files of server processes that are gone; returns their paths.

        Only host pools leave files; a dead process's GPU memory is freed by the driver.
        """
        if self.cuda_device is not None:
            return []
        removed = cleanup_stale(self.config.shm_dir, self.config.pool_prefix)
        if removed:
            log.info("removed %d stale pool files from %s", len(removed), self.config.shm_dir)
        return removed

    @property
    def kind(self) -> str:
        """``"cuda"`` when the pools live on a GPU, ``"host"`` otherwise."""
        return "host" if self.cuda_device is None else "cuda"

    @property
    def allocated_bytes(self) -> int:
        """Bytes carved into pools so far."""
        return sum(p.descriptor.capacity * p.descriptor.block_bytes for p in self._pools.values())

    @property
    def free_bytes(self) -> int:
        """Bytes of the budget not yet given to a pool."""
        return self.capacity_bytes - self.allocated_bytes

    def plan_capacity(self, block_bytes: int, requested_bytes: int) -> int:
        """Slots a new pool of ``block_bytes`` blocks gets for ``requested_bytes`` (0 = default).

        Raises:
            ResourceExhausted: not even one block fits in what is left.
        """
        want = requested_bytes or self.config.namespace_capacity_bytes
        grant = min(want, self.free_bytes)
        blocks = grant // block_bytes
        if blocks < 1:
            raise ResourceExhausted(
                f"no room for a namespace pool: a block is {block_bytes} bytes, "
                f"{self.free_bytes} of the node's {self.capacity_bytes} bytes are left"
                + (f" and {requested_bytes} were asked for" if requested_bytes else "")
            )
        return blocks

    def build(self, namespace: NamespaceId, block_bytes: int, capacity: int) -> BlockPool:
        """Create the pool of a namespace with ``capacity`` slots, not yet adopted.

        Touches only the file system and new memory, so it may run in a worker
        thread (prefaulting a large pool takes a while); `adopt` it afterwards.
        """
        if self.cuda_device is not None:
            return CudaPool.create(
                namespace,
                block_bytes,
                capacity,
                self.epoch,
                device=self.cuda_device.uuid,
                arena_bytes=self.config.arena_bytes,
                runtime=self.cuda_runtime,
            )
        return HostPool.create(
            namespace,
            block_bytes,
            capacity,
            self.epoch,
            directory=self.config.shm_dir,
            arena_bytes=self.config.arena_bytes,
            prefix=self.config.pool_prefix,
            mode=0o660 if self.config.pool_file_group else self.config.pool_file_mode,
            prefault=self.config.pool_prefault,
            group=pool_group_id(self.config.pool_file_group),
        )

    def adopt(self, namespace: NamespaceId, pool: BlockPool) -> None:
        """Count a built pool against the budget and own it from now on."""
        if namespace in self._pools:
            raise RuntimeError(f"bug: pool of namespace {namespace} created twice")
        self._pools[namespace] = pool
        d = pool.descriptor
        log.info(
            "namespace %s: pool of %d blocks x %d bytes in %d arenas",
            namespace,
            d.capacity,
            d.block_bytes,
            len(d.arenas),
        )

    def discard(self, namespace: NamespaceId) -> int:
        """Close and forget one pool (a dropped namespace); returns the bytes freed.

        Closing unlinks the arena files: a runner that still maps them keeps
        its (now private) memory until it unmaps, and cannot attach them again.
        """
        pool = self._pools.pop(namespace, None)
        if pool is None:
            return 0
        freed = pool.descriptor.capacity * pool.descriptor.block_bytes
        pool.close()
        log.info("namespace %s: pool closed, %d bytes back in the budget", namespace, freed)
        return freed

    def get(self, namespace: NamespaceId) -> BlockPool:
        """The pool of a registered namespace."""
        pool = self._pools.get(namespace)
        if pool is None:
            raise RuntimeError(f"bug: namespace {namespace} is registered without a pool")
        return pool

    def close(self) -> None:
        """Close every pool and unlink its files; idempotent."""
        while self._pools:
            namespace, pool = self._pools.popitem()
            try:
                pool.close()
            except Exception:
                log.exception("closing the pool of namespace %s failed", namespace)


def _open_device(config: Config, runtime: CudaRuntime | None) -> tuple[CudaRuntime, CudaDevice]:
    """The runtime and GPU of a CUDA node; every failure is a one-line `ConfigError`."""
    try:
        runtime = runtime or default_runtime()
        device = find_device(runtime, config.device)
    except (PoolUnavailable, InvalidArgument) as exc:
        raise ConfigError(f"device {config.device}: {exc}") from None
    log.info("pools on GPU %s (ordinal %d here)", device.uuid, device.ordinal)
    return runtime, device


def pool_group_id(group: str) -> int | None:
    """The gid of ``pool_file_group`` (a name or a number), None when empty.

    Raises:
        ConfigError: no such group on this host.
    """
    if not group:
        return None
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"pool_file_group {group!r}: no such group on this host") from None
