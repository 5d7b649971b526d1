"""Promotion: a lookup that runs past memory reads the rest back from disk into the pool.

The same shape as a peer fetch (`service.cluster.peer_fetch`): ask the tier's
index how many of the missing blocks it holds (no I/O), make room, open an
internal lease, reserve the missing blocks, read each one straight into its
reserved slot (`DiskTier.read_many`: all reads in flight at once, one wake-up
of the loop when the last has landed), commit the leading run that verified,
close the lease (which aborts the rest). The caller's lookup is then redone
against the store (`service.cluster.lookup`).

- **Verified**: the tier checks each block's slot header (identity) and
  checksum after the read; a block that fails is a miss, and so is the rest
  of the chain after it. A block whose own verdict (`DiskTier.read_many`,
  never a tier-wide count: up to `MAX_PROMOTIONS` run at once) is corrupt
  bytes is also counted in ``kvstore_checksum_failures_total{tier="disk"}``
  and logged; a failed read (EIO) or a block gone meanwhile is only a miss.
- **Typed outcome**: `promote` answers a `Promotion` (committed, or still
  running past ``disk_promote_timeout``), never a made-up count.
  Promoted blocks are committed with the checksum their read was verified
  against (the disk's), after the bytes where they landed were hashed and
  found to match it: a late write into a promotion's slot is a miss, never
  a block committed with a checksum of the wrong bytes. Later readers
  (peers, local loads) check them against it.
- **Bounded**: a lookup waits at most ``disk_promote_timeout`` for its
  promotion, then answers what memory holds (the blocks still being read
  are WRITING: a retry finds them READY). At most `MAX_PROMOTIONS` run at
  once; a lookup that finds them all busy answers from memory at once.
- **Nothing leaks, nothing is torn**: the promotion runs as its own task,
  which the lookup only waits for (shielded). A lookup that is cancelled or
  runs out of time leaves it to finish: a slot is never freed while a read
  into it may still be under way, and the lease is always closed. If the
  task itself cannot finish, the lease's expiry aborts its writes and the
  store quarantines their slots (late writers, docs/leases.md).
- **CUDA pools** have no host view: the block is read into host memory and
  copied to the device in a worker thread (`BlockPool.write`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import CollectorRegistry, Histogram

from kvstore.checksum import block_checksum
from kvstore.errors import KVStoreError
from kvstore.pool.base import BlockPool
from kvstore.types import BlockHash, LeaseId, NamespaceId, SlotId, TenantId
from service.cluster.fetch_lease import close_fetch_lease, open_fetch_lease, reserve_missing
from service.cluster.local import LocalNode
from service.disk.jobs import ReadResult
from service.disk.node_tier import NodeDisk
from service.disk.tier import DiskKey

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_PROMOTIONS = 8
"""Promotions running at once; beyond them a lookup is answered from memory."""

PROMOTION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Seconds from the index's answer to the commit (a 4 KiB-1 MiB block reads in 0.1-2 ms)."""


@dataclass(frozen=True, slots=True)
class Promotion:
    """What a lookup's promotion did by the time the lookup stopped waiting for it."""

    committed: int
    """Blocks read back and committed READY."""
    pending: bool = False
    """The promotion outlived ``disk_promote_timeout``: it goes on in the background,
    and some of its blocks may be READY already."""

    @property
    def look_again(self) -> bool:
        """Whether the pool may hold more of the chain now: redo the lookup."""
        return self.committed > 0 or self.pending


NOTHING = Promotion(0)
"""A promotion that did not start, or committed nothing."""


class DiskPromoter:
    """Reads blocks a lookup missed back from the disk tier into the node's pools."""

    def __init__(self, node: LocalNode, disk: NodeDisk, registry: CollectorRegistry) -> None:
        """Prepare the promoter; ``registry`` receives the promotion latency histogram."""
        self.node = node
        self.disk = disk
        self.promoted_blocks = 0
        """Blocks read back from disk and committed into a pool, ever (the disk hits)."""
        self.timeouts = 0
        """Lookups that stopped waiting for their promotion (``disk_promote_timeout``)."""
        self.checksum_failures = 0
        """Blocks whose bytes on disk were corrupt: discarded, a miss."""
        self.seconds = Histogram(
            "kvstore_disk_promotion_seconds",
            "Time to read a lookup's blocks back from disk and commit them",
            registry=registry,
            buckets=PROMOTION_BUCKETS,
        )

    async def promote(
        self, namespace: NamespaceId, tenant: TenantId, chain: Sequence[BlockHash], have: int
    ) -> Promotion:
        """Read ``chain[have:]``'s blocks on disk into the pool; what it committed.

        Waits at most ``disk_promote_timeout``; a timeout (`Promotion.pending`)
        or a cancellation leaves the promotion to finish in the background.
        """
        node = self.node
        if have >= len(chain) or len(self.disk.promotions) >= MAX_PROMOTIONS:
            return NOTHING
        table = node.table(namespace)
        on_disk = self.disk.run_after(table.spec, table.scope_of(tenant), chain, have)
        if not on_disk:
            return NOTHING
        task = asyncio.ensure_future(
            self._promote(namespace, tenant, list(chain[: have + on_disk]))
        )
        self.disk.promotions.add(task)
        task.add_done_callback(self.disk.promotions.discard)
        try:
            committed = await asyncio.wait_for(
                asyncio.shield(task), node.config.disk_promote_timeout
            )
        except TimeoutError:
            self.timeouts += 1
            log.info("promotion from disk in %s past disk_promote_timeout: served", namespace)
            return Promotion(0, pending=True)  # some blocks may be READY already
        return Promotion(committed)

    async def _promote(
        self, namespace: NamespaceId, tenant: TenantId, target: list[BlockHash]
    ) -> int:
        node = self.node
        started = time.perf_counter()
        lease_id: LeaseId | None = None
        try:
            await node.make_room(node.table(namespace), tenant, target)
            lease_id = open_fetch_lease(node, tenant)
            wanted = reserve_missing(node, namespace, tenant, lease_id, target)
            if not wanted:
                return 0  # hits or in flight meanwhile, or no room
            table = node.table(namespace)
            scope = table.scope_of(tenant)
            todo = [h for h in target if h in wanted]
            keys = [self.disk.key(table.spec, scope, h) for h in todo]
            now = node.now()
            slots = [node.store.writing_slot(namespace, tenant, lease_id, h, now) for h in todo]
            sums = await self._read_run(namespace, node.pool(namespace), todo, keys, slots)
            good, checksums = todo[: len(sums)], sums
            if good:
                self.disk.promoting.update(keys[: len(good)])
                try:
                    node.store.commit(namespace, tenant, lease_id, good, node.now(), checksums)
                    close_fetch_lease(node, tenant, lease_id)  # publishes the STORED events
                    lease_id = None
                finally:
                    self.disk.promoting.difference_update(keys[: len(good)])
                self.promoted_blocks += len(good)
                self.seconds.observe(time.perf_counter() - started)
            return len(good)
        except KVStoreError as exc:  # e.g. the namespace was dropped meanwhile
            log.info("promotion from disk in %s gave up: %s", namespace, exc)
            return 0
        except (OSError, ValueError) as exc:  # the disk's failure is a miss, never the lookup's
            log.warning("promotion from disk in %s failed: %s", namespace, exc)
            return 0
        finally:
            if lease_id is not None:
                close_fetch_lease(node, tenant, lease_id)  # aborts what was not committed

    async def _read_run(
        self,
        namespace: NamespaceId,
        pool: BlockPool,
        todo: list[BlockHash],
        keys: list[DiskKey],
        slots: list[SlotId],
    ) -> list[int]:
        """Read the blocks into their reserved slots, all in flight at once; returns the
        checksums (as the bytes landed) of the leading run that verified."""
        tier = self.disk.tier
        size = pool.descriptor.block_bytes
        present = [tier.length_of(key) == size for key in keys]
        n = present.index(False) if False in present else len(keys)  # evicted meanwhile
        # What each read is verified against, and what the block is committed with:
        # never a hash of the slot alone, which a late writer may have changed.
        expected = [tier.checksum_of(key) for key in keys[:n]]
        cuda = pool.descriptor.kind == "cuda"
        dests = [memoryview(bytearray(size)) if cuda else pool.view(slot) for slot in slots[:n]]
        verdicts = await tier.read_many(keys[:n], dests)  # returns once every read has landed
        ok = [v is ReadResult.OK for v in verdicts]
        run = ok.index(False) if False in ok else n
        if run < n and verdicts[run] in (ReadResult.IDENTITY, ReadResult.CHECKSUM):
            # This block's own verdict (other promotions run beside this one):
            # discarded by the tier for its header or checksum, corrupt bytes.
            self.checksum_failures += 1
            self.node.checksum_failed(namespace, "disk", todo[run], self.node.node_id)
        loop = asyncio.get_running_loop()
        landed = await _landed(loop.run_in_executor(None, _settle, pool, slots[:run], dests[:run]))
        # The bytes hashed where they landed, after the tier verified them: a
        # late write into the slot in between is a miss, not a commit (issue 40).
        same = [got == want for got, want in zip(landed, expected, strict=False)]
        good = same.index(False) if False in same else len(landed)
        if good < len(landed):
            self.checksum_failures += 1
            self.node.checksum_failed(namespace, "local", todo[good], self.node.node_id)
        return [int(c) for c in expected[:good] if c is not None]


def _settle(pool: BlockPool, slots: list[SlotId], landed: list[memoryview]) -> list[int]:
    """In a worker thread: copy host staging into a CUDA pool's slots; the checksums of
    the bytes as they landed (a CUDA pool: of the staging copied from)."""
    if pool.descriptor.kind == "cuda":
        for slot, staging in zip(slots, landed, strict=True):
            pool.write(slot, staging)
    return [block_checksum(view) for view in landed]


async def _landed(job: asyncio.Future[T]) -> T:
    """Await a worker thread's job to its end, cancelled or not: a slot must not be freed
    (the lease closed) while a write into it may still land."""
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait({job})
        raise
