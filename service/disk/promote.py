"""Promotion: a lookup that runs past memory reads the rest back from disk into the pool.

The same shape as a peer fetch (`service.cluster.peer_fetch`): ask the tier's
index how many of the missing blocks it holds (no I/O), make room, open an
internal lease, reserve the missing blocks, read each one straight into its
reserved slot (`DiskTier.read_into`, all reads in flight at once), commit the
leading run that verified, close the lease (which aborts the rest). The
caller's lookup is then redone against the store (`service.cluster.lookup`).

- **Verified**: the tier checks each block's slot header (identity) and
  checksum after the read; a block that fails is a miss, and so is the rest
  of the chain after it. A failure the tier counted as corrupt bytes is also
  counted in ``kvstore_checksum_failures_total{tier="disk"}`` and logged.
  Promoted blocks are committed with their checksum, computed where they
  landed, so later readers (peers, ``verify_checksums = "all"``) check them.
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
from enum import Enum

from prometheus_client import CollectorRegistry, Histogram

from kvstore.checksum import block_checksum
from kvstore.errors import KVStoreError
from kvstore.pool.base import BlockPool
from kvstore.types import BlockHash, LeaseId, NamespaceId, SlotId, TenantId
from service.cluster.fetch_lease import close_fetch_lease, open_fetch_lease, reserve_missing
from service.cluster.local import LocalNode
from service.disk.node_tier import NodeDisk
from service.disk.tier import DiskKey, DiskTier

log = logging.getLogger(__name__)

MAX_PROMOTIONS = 8
"""Promotions running at once; beyond them a lookup is answered from memory."""

PROMOTION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Seconds from the index's answer to the commit (a 4 KiB-1 MiB block reads in 0.1-2 ms)."""


class Miss(Enum):
    """Why a block read back from disk is not promoted."""

    ABSENT = "absent"
    """Not on disk (any more), or the read met an I/O error: a plain miss."""
    CORRUPT = "corrupt"
    """Its identity or checksum did not verify: the tier discarded it."""


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
    ) -> int:
        """Read ``chain[have:]``'s blocks on disk into the pool; how many were committed.

        Waits at most ``disk_promote_timeout``; a timeout or a cancellation
        leaves the promotion to finish in the background.
        """
        node = self.node
        if have >= len(chain) or len(self.disk.promotions) >= MAX_PROMOTIONS:
            return 0
        table = node.table(namespace)
        on_disk = self.disk.run_after(table.spec, table.scope_of(tenant), chain, have)
        if not on_disk:
            return 0
        task = asyncio.ensure_future(
            self._promote(namespace, tenant, list(chain[: have + on_disk]))
        )
        self.disk.promotions.add(task)
        task.add_done_callback(self.disk.promotions.discard)
        try:
            return await asyncio.wait_for(asyncio.shield(task), node.config.disk_promote_timeout)
        except TimeoutError:
            self.timeouts += 1
            log.info("promotion from disk in %s past disk_promote_timeout: served", namespace)
            return 1  # some blocks may be READY already: look again

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
            pool = node.pool(namespace)
            # Every read ends before anything below can free a slot (return_exceptions:
            # one failing read must not leave the others running into aborted slots).
            sums = await asyncio.gather(
                *(self._read(pool, key, slot) for key, slot in zip(keys, slots, strict=True)),
                return_exceptions=True,
            )
            good: list[BlockHash] = []
            checksums: list[int] = []
            for block_hash, checksum in zip(todo, sums, strict=True):
                if isinstance(checksum, BaseException):
                    log.warning("disk read of %s failed: %r", block_hash.hex()[:16], checksum)
                    break
                if isinstance(checksum, Miss):
                    if checksum is Miss.CORRUPT:
                        self.checksum_failures += 1
                        node.checksum_failed(namespace, "disk", block_hash, node.node_id)
                    break  # this block and the rest of the run: a miss
                good.append(block_hash)
                checksums.append(checksum)
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

    async def _read(self, pool: BlockPool, key: DiskKey, slot: SlotId) -> int | Miss:
        """Read one block into its slot: its checksum as it landed, or why it is a miss."""
        tier = self.disk.tier
        if tier.length_of(key) != pool.descriptor.block_bytes:
            return Miss.ABSENT  # evicted since the index answered (or, a bug, another length)
        if pool.descriptor.kind == "cuda":
            staging = bytearray(pool.descriptor.block_bytes)
            if not await tier.read_into(key, memoryview(staging)):
                return _why(tier, key)
            loop = asyncio.get_running_loop()
            await _landed(loop.run_in_executor(None, pool.write, slot, staging))
            return await asyncio.to_thread(block_checksum, staging)
        dest = pool.view(slot)
        if not await tier.read_into(key, dest):
            return _why(tier, key)
        return await asyncio.to_thread(block_checksum, dest)


async def _landed(job: asyncio.Future[None]) -> None:
    """Await a worker thread's write into a slot to its end, cancelled or not: the slot
    must not be freed (the lease closed) while the write may still land in it."""
    try:
        await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait({job})
        raise


def _why(tier: DiskTier, key: DiskKey) -> Miss:
    """Why a read of a block that was on disk failed: the tier discards a block whose
    identity or checksum did not verify (corrupt); one it still holds met an I/O error."""
    return Miss.CORRUPT if tier.length_of(key) is None else Miss.ABSENT
