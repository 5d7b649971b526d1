"""The node's memory budget, drawn on by namespace pools arena by arena.

`PoolManager` owns one `ArenaPool` per namespace on the node's device
(host shared memory for ``device = "cpu"``, a GPU otherwise). A pool starts
with one arena and grows by whole arenas while its namespace needs slots
(`Node.make_room`), up to its ceiling (the bytes RegisterNamespace asked
for, else `namespace_capacity_bytes`, else the whole budget); every arena
counts against the node's `capacity_bytes`. The last arena of a pool can be
given back (its blocks evicted first) when another namespace needs the
memory, and a dropped namespace gives back all of them. The manager does
the accounting and the memory; *which* arena moves is the node's decision.

Pool files of dead servers are removed at start (`cleanup_stale`). The epoch
is random per server start, so a runner can tell a restarted node's pools
from the ones it mapped before; the arena-set version (`PoolDescriptor.version`)
changes whenever a pool gains or loses an arena, and is unique in the epoch.

A CUDA node checks its GPU when the manager is built (at server start): no
cupy, no GPU or not that GPU is a `ConfigError` naming the device, which the
server reports in one line with exit code 2. One node serves one GPU; run a
node per GPU (see docs/cuda.md).
"""

from __future__ import annotations

import grp
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from kvstore.errors import InvalidArgument
from kvstore.pool import host_pages
from kvstore.pool.arenas import ArenaPool
from kvstore.pool.base import BlockPool, PoolUnavailable
from kvstore.pool.cuda import IPC_GRANULARITY, CudaDevice, CudaPool, find_device
from kvstore.pool.cuda_runtime import CudaRuntime, default_runtime
from kvstore.pool.host import HostPool, cleanup_stale
from kvstore.types import LeaseId, NamespaceId, SlotId
from kvstore.v1 import kvstore_pb2 as pb
from service.api.errors import ResourceExhausted
from service.config import Config, ConfigError
from service.memory.held import HeldArenas

log = logging.getLogger(__name__)


def new_epoch() -> int:
    """A random nonzero 63-bit pool epoch."""
    return secrets.randbits(63) or 1


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """The geometry of a namespace pool, fixed when it is registered."""

    block_bytes: int
    """Bytes of one block."""
    slots_per_arena: int
    """Slots in each arena."""
    max_arenas: int
    """Arenas the pool may grow to (at least 1)."""
    granule: int = 1
    """Allocation unit of the device: an arena costs its bytes rounded up to it."""

    @property
    def arena_bytes(self) -> int:
        """Bytes of the slots of one arena."""
        return self.slots_per_arena * self.block_bytes

    @property
    def arena_cost(self) -> int:
        """Bytes of the budget one arena takes: CUDA arenas are whole 2 MiB blocks."""
        return -(-self.arena_bytes // self.granule) * self.granule


class ArenaWatcher(Protocol):
    """Told when an arena joins a pool and before one leaves (the NIXL registrations)."""

    def added(self, namespace: NamespaceId, pool: ArenaPool, index: int) -> None:
        """Arena ``index`` of ``namespace``'s pool is new."""

    def removing(self, namespace: NamespaceId, index: int) -> None:
        """Arena ``index`` of ``namespace``'s pool is about to be given back."""


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
        self._pools: dict[NamespaceId, ArenaPool] = {}
        self._plans: dict[NamespaceId, PoolPlan] = {}
        self._serial = 0
        """Arena file numbers and arena-set versions: unique in the epoch."""
        self._building = 0
        """Bytes of arenas being built (promised, not yet adopted)."""
        self.held = HeldArenas()
        """CUDA arenas out of their pools that runners may still map (`service.memory.held`)."""
        self.watcher: ArenaWatcher | None = None
        """Told of every arena added and removed (`watch`)."""
        self.cuda_runtime: CudaRuntime | None = None
        self.cuda_device: CudaDevice | None = None
        """The GPU of the pools; None for host pools."""
        if config.device != "cpu":
            self.cuda_runtime, self.cuda_device = _open_device(config, cuda_runtime)
        else:
            offer = host_pages.support(config.shm_dir)
            if config.pool_huge_pages == "on" and not offer.possible:
                raise ConfigError(f"pool_huge_pages is on, but no huge pages: {offer.reason}")
            if config.pool_huge_pages != "off":
                log.info("pool huge pages %s: %s", "offered" if offer.possible else "not offered",
                         offer.reason)  # fmt: skip

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
        """Bytes of the arenas of every pool (and of arenas being built, or held)."""
        pools = sum(p.descriptor.total_bytes for p in self._pools.values())
        return pools + self._building + self.held.held_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes of the budget in no arena."""
        return self.capacity_bytes - self.allocated_bytes

    def watch(self, watcher: ArenaWatcher) -> None:
        """Tell ``watcher`` of every arena now and of each one added or removed from now on."""
        assert self.watcher is None, "bug: a second arena watcher"
        self.watcher = watcher
        for namespace, pool in self._pools.items():
            for index in range(pool.arenas):
                watcher.added(namespace, pool, index)

    def unwatch(self) -> None:
        """Tell the watcher every arena is leaving, and stop telling it."""
        watcher, self.watcher = self.watcher, None
        if watcher is not None:
            for namespace, pool in self._pools.items():
                for index in reversed(range(pool.arenas)):
                    watcher.removing(namespace, index)

    def _removing(self, namespace: NamespaceId, pool: ArenaPool, last: bool = True) -> None:
        """Tell the watcher that the last arena (or all, ``last=False``) is leaving."""
        if self.watcher is None:
            return
        first = pool.arenas - 1 if last else 0
        for index in reversed(range(first, pool.arenas)):
            self.watcher.removing(namespace, index)

    def next_serial(self) -> int:
        """A number never handed out before in this epoch."""
        self._serial += 1
        return self._serial

    # --- planning ---------------------------------------------------------------------

    def plan(self, block_bytes: int, requested_bytes: int) -> PoolPlan:
        """The geometry of a new pool of ``block_bytes`` blocks.

        The ceiling is ``requested_bytes``, else `namespace_capacity_bytes`,
        else the budget, never more than the budget; an arena is
        `arena_bytes` or the ceiling if smaller, in whole blocks, and the
        ceiling is rounded down to whole arenas.

        Raises:
            ResourceExhausted: not even one block fits under the ceiling.
        """
        ceiling = min(
            requested_bytes or self.config.namespace_capacity_bytes or self.capacity_bytes,
            self.capacity_bytes,
        )
        slots_per_arena = min(self.config.arena_bytes, ceiling) // block_bytes
        if slots_per_arena < 1:
            raise ResourceExhausted(
                f"no room for a namespace pool: a block is {block_bytes} bytes, the pool may "
                f"hold {ceiling} of the node's {self.capacity_bytes} bytes"
                + (f" ({requested_bytes} were asked for)" if requested_bytes else "")
            )
        granule = IPC_GRANULARITY if self.cuda_device is not None else 1
        one = PoolPlan(block_bytes, slots_per_arena, 1, granule)
        return replace(one, max_arenas=max(1, ceiling // one.arena_cost))

    def plan_of(self, namespace: NamespaceId) -> PoolPlan:
        """The geometry of a registered namespace's pool."""
        return self._plans[namespace]

    def arenas(self, namespace: NamespaceId) -> int:
        """Arenas the namespace's pool holds now."""
        return self.get(namespace).arenas

    def pool_bytes(self, namespace: NamespaceId) -> int:
        """Bytes of the namespace's pool."""
        return self.get(namespace).descriptor.total_bytes

    def namespaces(self) -> list[NamespaceId]:
        """Namespaces with a pool."""
        return list(self._pools)

    # --- memory -----------------------------------------------------------------------

    def promise(self, nbytes: int) -> bool:
        """Count ``nbytes`` as allocated before the arena exists (False: no room).

        Every `promise` is settled by `adopt`, `grow` or `settle`.
        """
        if nbytes > self.free_bytes:
            return False
        self._building += nbytes
        return True

    def settle(self, nbytes: int) -> None:
        """Forget a promise whose arena was not built (or is adopted)."""
        self._building -= nbytes
        assert self._building >= 0, "bug: settling more than was promised"

    def build_arena(self, namespace: NamespaceId, plan: PoolPlan, serial: int) -> BlockPool:
        """Create one arena of a namespace's pool; not yet part of it.

        Touches only the file system and new memory, so it may run in a
        worker thread (prefaulting takes a while); `adopt` or `grow` it afterwards.
        """
        spa = plan.slots_per_arena
        # One rule for every pool file, host arena or CUDA stamp file: with a
        # pool_file_group the runners of that group read and write them.
        mode = 0o660 if self.config.pool_file_group else self.config.pool_file_mode
        group = pool_group_id(self.config.pool_file_group)
        if self.cuda_device is not None:
            return CudaPool.create(
                namespace,
                plan.block_bytes,
                spa,
                self.epoch,
                device=self.cuda_device.uuid,
                arena_bytes=plan.arena_bytes,
                runtime=self.cuda_runtime,
                # The slot stamps live in host shared memory, named like host
                # arenas (so `cleanup_stale` finds them): runners read them
                # without a GPU sync.
                stamp_directory=self.config.shm_dir,
                prefix=self.config.pool_prefix,
                mode=mode,
                group=group,
                first_index=serial,
            )
        return HostPool.create(
            namespace,
            plan.block_bytes,
            spa,
            self.epoch,
            directory=self.config.shm_dir,
            arena_bytes=plan.arena_bytes,
            prefix=self.config.pool_prefix,
            mode=mode,
            prefault=self.config.pool_prefault,
            group=group,
            first_index=serial,
            huge_pages=self.config.pool_huge_pages,  # type: ignore[arg-type]
        )

    @property
    def huge_page_bytes(self) -> int:
        """Bytes of the host pools the kernel backs with huge pages (as measured when built)."""
        return sum(p.huge_page_bytes for p in self._pools.values())

    def adopt(
        self,
        namespace: NamespaceId,
        first: BlockPool,
        plan: PoolPlan,
        stamps: PoolStamps | None = None,
    ) -> None:
        """Own a new namespace's pool, made of its first (promised) arena.

        ``stamps`` (the sink its block table was made with, if any) writes
        into the pool's stamp table from now on.
        """
        if namespace in self._pools:
            raise RuntimeError(f"bug: pool of namespace {namespace} created twice")
        self._pools[namespace] = ArenaPool(first, self.next_serial())
        if stamps is not None:
            stamps.bind(self._pools[namespace])
        self._plans[namespace] = plan
        self.settle(plan.arena_cost)
        if self.watcher is not None:
            self.watcher.added(namespace, self._pools[namespace], 0)
        log.info(
            "namespace %s: pool of %d-byte blocks, %d per arena, up to %d arenas; "
            "%d of %d bytes in huge pages",
            namespace,
            plan.block_bytes,
            plan.slots_per_arena,
            plan.max_arenas,
            first.huge_page_bytes,
            plan.arena_bytes,
        )

    def grow(self, namespace: NamespaceId, arena: BlockPool) -> None:
        """Append a built (promised) arena to a namespace's pool."""
        pool = self.get(namespace)
        pool.append(arena, self.next_serial())
        self.settle(self._plans[namespace].arena_cost)
        if self.watcher is not None:
            self.watcher.added(namespace, pool, pool.arenas - 1)

    def shrink(self, namespace: NamespaceId) -> int:
        """Take the last arena out of a namespace's pool; returns the bytes freed now.

        The caller has retired its slots first (`BlockTable.resize`). A CUDA
        arena that a runner may still map is held (0 bytes freed now) until
        no runner does (`HeldArenas`).
        """
        pool = self.get(namespace)
        self._removing(namespace, pool)
        version = self.next_serial()
        arena = pool.pop(version)
        cost = self._plans[namespace].arena_cost
        held = self.held.held_bytes
        self._retire(namespace, arena, version, cost)
        return cost - (self.held.held_bytes - held)

    def discard(self, namespace: NamespaceId) -> int:
        """Close and forget one pool (a dropped namespace); returns the bytes freed.

        Closing unlinks the arena files: a runner that still maps them keeps
        its (now private) memory until it unmaps, and cannot attach them again.
        """
        pool = self._pools.pop(namespace, None)
        self._plans.pop(namespace, None)
        if pool is None:
            return 0
        self._removing(namespace, pool, last=False)
        freed = pool.descriptor.total_bytes
        if self.cuda_device is None:
            pool.close()
        else:  # runners may still have its arenas open: each is held until none does
            gone_at = self.next_serial()
            cost = freed // pool.arenas
            for arena in pool.take_arenas():
                self.held.hold(namespace, arena, gone_at, cost)
        log.info("namespace %s: pool closed, %d bytes back in the budget", namespace, freed)
        return freed

    def report_mapped(self, lease_id: LeaseId, versions: Sequence[pb.PoolVersion]) -> None:
        """What a lease's runner maps now (`HeldArenas.report`); CUDA pools only.

        Only namespaces with a pool or a held arena are kept: a report's
        size cannot grow the node's memory.
        """
        if self.cuda_device is None:
            return
        known = set(self._pools) | self.held.namespaces()
        self.held.report(
            lease_id, {v.namespace_id: v.version for v in versions if v.namespace_id in known}
        )

    def _retire(self, namespace: NamespaceId, arena: BlockPool, gone_at: int, cost: int) -> None:
        """Close an arena taken out of a pool; a CUDA one once no runner maps it."""
        if self.cuda_device is None:
            arena.close()  # a host file unlinked while mapped stays valid for its mappers
        else:
            self.held.hold(namespace, arena, gone_at, cost)

    def get(self, namespace: NamespaceId) -> ArenaPool:
        """The pool of a registered namespace."""
        pool = self._pools.get(namespace)
        if pool is None:
            raise RuntimeError(f"bug: namespace {namespace} is registered without a pool")
        return pool

    def close(self) -> None:
        """Close every pool and unlink its files; idempotent."""
        self._plans.clear()
        self.held.close()
        self.unwatch()
        while self._pools:
            namespace, pool = self._pools.popitem()
            try:
                pool.close()
            except Exception:
                log.exception("closing the pool of namespace %s failed", namespace)


class PoolStamps:
    """The `kvstore.stamps.StampSink` of a namespace's block table: its pool's stamp table.

    Made before the pool is adopted (the table is made between the first
    arena and the adoption, and stamps nothing until its first Reserve),
    bound to the namespace's `ArenaPool` once, at adoption: a table of a
    dropped namespace never writes into the pool of one registered again.
    """

    __slots__ = ("_bound", "stamp")

    def __init__(self) -> None:
        self._bound = False
        self.stamp: Callable[[SlotId, int, int], None] = _unbound
        """Write one slot's stamp: the pool's `ArenaPool.stamp` itself once bound
        (no call in between: it runs twice for every block written)."""

    def bind(self, pool: ArenaPool) -> None:
        """Write into ``pool``'s stamp table from now on (once)."""
        assert not self._bound, "bug: a namespace's stamps bound twice"
        self._bound = True
        self.stamp = pool.stamp


def _unbound(slot: SlotId, generation: int, ident: int) -> None:
    raise RuntimeError("bug: a slot stamped before its pool was adopted")


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
