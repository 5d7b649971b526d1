"""Arenas in and out of namespace pools: on demand, under pressure, on drop.

`NamespaceMemory` is the node's policy over the `PoolManager` (the memory)
and the store's block tables (the slots):

- **Registration** gives a namespace one arena. When the budget has no room
  for it, arenas are taken back from other namespaces first (below). Then
  the pool grows to its headroom (next point) before RegisterNamespace
  answers, so the runner maps those arenas with the first.
- **Headroom, ahead of need**: a pool keeps ``pool_headroom_bytes`` of free
  slots (in whole arenas) ready, so a store finds allocated memory and
  already mapped arenas instead of waiting for an arena to be built. When a
  commit leaves fewer free slots, the next arenas are built in a background
  task (one at a time, off the event loop), never blocking a Reserve; after
  the commit, not the Reserve, so the build does not compete with the
  runner's copy. Growth ahead of need spends only free budget: it never
  takes arenas back from other namespaces, and it stops at the pool's
  ceiling. The node never allocates its whole budget up front.
- **Growth on demand**: before a Reserve, a namespace whose free slots fall
  short of the chain's missing blocks gets more arenas, up to its ceiling,
  while the budget (after taking back) allows; a Reserve that finds
  headroom being built waits for that arena rather than building another.
  Otherwise the reserve evicts the namespace's own least recently used
  blocks, or answers NO_ROOM for what does not fit: a shortfall is a
  partial reservation, never a crash. A full tmpfs (fallocate's ENOSPC) or
  GPU is the same shortfall, logged.
- **Giving back under pressure**: the last arena of another namespace is
  retired (its READY blocks evicted, REMOVED events sent) and its memory
  returned, least recently active namespace first. Eligible: a namespace
  with more than its one minimum arena that is empty, or that would still
  hold at least as many bytes as the asker after the move, so two busy
  namespaces converge on equal shares instead of trading an arena back and
  forth. An arena holding a pinned or WRITING block is never retired. A
  CUDA arena that a runner may still map is freed only once none does
  (`service.memory.held`); until then its bytes stay allocated.
- **Drop**: every arena of the namespace goes back at once.

One asyncio lock orders every change of the budget, so two growths never
spend the same bytes. A namespace whose growth failed is not retried for
`RETRY_SECONDS`, so a full node does not rescan on every Reserve.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from kvstore.block_table import BlockTable
from kvstore.errors import LimitExceeded, UnknownNamespace
from kvstore.ops.plural import plural
from kvstore.pool.base import BlockPool
from kvstore.stamps import StampSink
from kvstore.store import DropReport, Store
from kvstore.types import BlockHash, NamespaceId, TenantId
from service.api.errors import ResourceExhausted
from service.memory.budget import PoolManager, PoolPlan, PoolStamps

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0
"""How long a namespace whose growth failed waits before it tries again."""


class NamespaceMemory:
    """Grows, shrinks, creates and drops namespace pools within the node's budget."""

    def __init__(
        self,
        pools: PoolManager,
        store: Store,
        clock: Callable[[], float],
        publish: Callable[[], None],
        headroom_bytes: int = 0,
    ) -> None:
        """Wire the pools and the store; ``publish`` sends the store's pending events.

        ``headroom_bytes``: free slots (in bytes) each pool keeps ready ahead of need.
        """
        self.pools = pools
        self.store = store
        self.clock = clock
        self.publish = publish
        self.headroom_bytes = headroom_bytes
        self.lock = asyncio.Lock()
        """Held by every change of the budget (and by registrations)."""
        self._active: dict[NamespaceId, float] = {}
        self._retry_at: dict[NamespaceId, float] = {}
        self._ahead: dict[NamespaceId, asyncio.Task[None]] = {}
        """The background growth of each namespace that is building headroom now."""

    def touch(self, namespace: NamespaceId) -> None:
        """Mark a namespace as used now (its arenas are taken back last)."""
        self._active[namespace] = self.clock()

    # --- registration and drop ----------------------------------------------------------

    async def create(
        self, namespace: NamespaceId, block_bytes: int, requested_bytes: int,
        make_table: Callable[[int, StampSink], BlockTable],
    ) -> BlockTable:  # fmt: skip
        """Build the first arena of a new namespace, then its table (``make_table(slots, stamps)``).

        ``stamps`` is the sink the table writes slot stamps through: the pool's
        stamp table once the pool is adopted (`PoolStamps`).

        Call with `lock` held.

        Raises:
            ResourceExhausted: no arena fits, even after taking some back.
        """
        plan = self.pools.plan(block_bytes, requested_bytes)
        if not self._promise(plan.arena_cost, None):
            raise ResourceExhausted(
                f"no room for a namespace pool of {plan.arena_cost} bytes: "
                f"{self.pools.free_bytes} of the node's {self.pools.capacity_bytes} bytes are "
                "free and no other namespace can give an arena back (drop one, or raise "
                "capacity_bytes)"
            )
        try:
            first = await _build(self.pools, namespace, plan)
        except BaseException:
            self.pools.settle(plan.arena_cost)
            raise
        try:
            stamps = PoolStamps()
            table = make_table(plan.slots_per_arena, stamps)
        except BaseException:
            first.close()
            self.pools.settle(plan.arena_cost)
            raise
        self.pools.adopt(namespace, first, plan, stamps)
        self.touch(namespace)
        await self._grow(table, plan, self._headroom_need(table, plan), ahead=True)
        return table

    async def drop(self, namespace: NamespaceId, force: bool) -> tuple[DropReport, int]:
        """Drop a namespace from the store and give all its arenas back."""
        async with self.lock:
            try:
                report = self.store.drop_namespace(namespace, self.clock(), force=force)
            finally:
                self.publish()
            freed = self.pools.discard(namespace)
            self._active.pop(namespace, None)
            self._retry_at.pop(namespace, None)
        return report, freed

    # --- growth -------------------------------------------------------------------------

    async def make_room(
        self, table: BlockTable, tenant: TenantId, chain: Sequence[BlockHash]
    ) -> None:
        """Grow ``table``'s pool before a reserve of ``chain`` if its free slots fall short."""
        namespace = table.namespace
        now = self.clock()
        self._active[namespace] = now
        if self._retry_at.get(namespace, 0.0) > now:
            return
        plan = self.pools.plan_of(namespace)
        if self.pools.arenas(namespace) < plan.max_arenas and table.shortfall(tenant, chain):
            async with self.lock:
                if not self._registered(table):
                    return  # dropped (and maybe registered again) while we waited
                grown = await self._grow(table, plan, table.shortfall(tenant, chain))
            if not grown:
                self._retry_at[namespace] = self.clock() + RETRY_SECONDS

    def keep_ahead(self, table: BlockTable) -> None:
        """After a commit: build headroom in the background if the free slots are under it.

        Not after the Reserve: the runner copies its blocks between the two,
        and an arena built meanwhile (the kernel zeroing its pages) would
        compete with that copy for the CPU and memory bandwidth; after the
        commit it competes with nothing of this store's.
        """
        if not self.headroom_bytes or not self._registered(table):
            return
        if self._retry_at.get(table.namespace, 0.0) > self.clock():
            return
        plan = self.pools.plan_of(table.namespace)
        if self._headroom_need(table, plan) > 0:
            self._grow_ahead(table, plan)

    def _headroom_need(self, table: BlockTable, plan: PoolPlan) -> int:
        """Slots the pool lacks to keep its headroom (0 when it has it or is at its ceiling)."""
        if not self.headroom_bytes or self.pools.arenas(table.namespace) >= plan.max_arenas:
            return 0
        headroom = -(-self.headroom_bytes // plan.block_bytes)
        return max(0, headroom - table.free_slots)

    def _grow_ahead(self, table: BlockTable, plan: PoolPlan) -> None:
        """Build headroom in a background task, one per namespace at a time."""
        namespace = table.namespace
        if namespace in self._ahead or self.pools.free_bytes < plan.arena_cost:
            return  # already at it, or no budget to spend without taking back

        async def grow() -> None:
            try:
                async with self.lock:
                    need = self._headroom_need(table, plan)
                    wanted = need > 0 and self._registered(table)
                    if wanted and not await self._grow(table, plan, need, ahead=True):
                        self._retry_at[namespace] = self.clock() + RETRY_SECONDS
            except Exception:  # a bug; never leave the task's exception unretrieved
                log.exception("namespace %s: growing ahead of need failed", namespace)
            finally:
                self._ahead.pop(namespace, None)

        self._ahead[namespace] = asyncio.ensure_future(grow())

    async def stop(self) -> None:
        """Cancel growth ahead of need and wait for it (arenas it built are closed).

        Call before the pools are closed.
        """
        tasks = list(self._ahead.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _grow(
        self, table: BlockTable, plan: PoolPlan, need: int, ahead: bool = False
    ) -> bool:
        """Add arenas until ``need`` slots are covered; False when none could be added.

        ``ahead``: spend only free budget (growth ahead of need takes no arena back).
        """
        namespace = table.namespace
        added = 0
        while need > 0 and self.pools.arenas(namespace) < plan.max_arenas:
            promised = (
                self.pools.promise(plan.arena_cost)
                if ahead
                else self._promise(plan.arena_cost, namespace)
            )
            if not promised:
                break
            try:
                arena = await _build(self.pools, namespace, plan)
            except LimitExceeded as exc:  # tmpfs or GPU memory full: a shortfall, not a crash
                self.pools.settle(plan.arena_cost)
                log.warning("namespace %s: cannot add an arena: %s", namespace, exc)
                break
            except BaseException:
                self.pools.settle(plan.arena_cost)
                raise
            self.pools.grow(namespace, arena)
            table.resize(plan.slots_per_arena, self.clock())
            need -= plan.slots_per_arena
            added += 1
        if added:
            log.info(
                "namespace %s: +%s%s, now %d (%d bytes free in the budget)",
                namespace,
                plural(added, "arena"),
                " ahead of need" if ahead else "",
                self.pools.arenas(namespace),
                self.pools.free_bytes,
            )
        return added > 0 or need <= 0

    def _registered(self, table: BlockTable) -> bool:
        try:
            return self.store.table(table.namespace) is table
        except UnknownNamespace:
            return False

    # --- giving back ------------------------------------------------------------------------

    def _promise(self, nbytes: int, asker: NamespaceId | None) -> bool:
        """Promise ``nbytes`` of the budget, taking arenas back from others if needed."""
        if self.pools.promise(nbytes):
            return True
        self._take_back(nbytes, asker)
        return self.pools.promise(nbytes)

    def _take_back(self, nbytes: int, asker: NamespaceId | None) -> None:
        """Retire last arenas of other namespaces until ``nbytes`` are free (if they allow)."""
        pools = self.pools
        mine = pools.pool_bytes(asker) if asker is not None else 0
        now = self.clock()
        others = [ns for ns in pools.namespaces() if ns != asker and pools.arenas(ns) > 1]
        others.sort(key=lambda ns: self._active.get(ns, 0.0))
        for namespace in others:
            table = self.store.table(namespace)
            spa = pools.plan_of(namespace).slots_per_arena
            while pools.free_bytes < nbytes and pools.arenas(namespace) > 1:
                share_ok = pools.pool_bytes(namespace) - pools.plan_of(namespace).arena_cost >= (
                    mine + nbytes
                )
                if not (share_ok or len(table) == 0) or not table.resize(-spa, now):
                    break
                freed = pools.shrink(namespace)
                if not freed:  # held until its runners move on: it frees nothing now
                    log.info("namespace %s gave an arena back; runners still map it", namespace)
                    break
                log.info(
                    "namespace %s gave an arena (%d bytes) back to the budget", namespace, freed
                )
            if pools.free_bytes >= nbytes:
                break
        self.publish()  # the retired arenas' blocks were evicted


async def _build(pools: PoolManager, namespace: NamespaceId, plan: PoolPlan) -> BlockPool:
    """Build one arena in a worker thread (prefaulting takes time); never leak it."""
    serial = pools.next_serial()
    task = asyncio.ensure_future(asyncio.to_thread(pools.build_arena, namespace, plan, serial))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        # The caller went away: close the arena whenever the thread finishes.
        task.add_done_callback(
            lambda t: t.result().close() if not t.cancelled() and t.exception() is None else None
        )
        # Wait for that (the caller still holds the lock), so what follows
        # never races this arena's memory.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({task})
        raise
