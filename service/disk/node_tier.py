"""The disk tier as the node drives it: keys, write-behind at commit, drop, clean stop.

`DiskTier` (`service.disk.tier`) stores bytes under a `DiskKey`; this module
decides what goes down and when (docs/disk.md):

- **Keys** are stable across restarts: the namespace's 16-byte digest is the
  first half of `NamespaceSpec.digest` (model id, layout, hash scheme, seed),
  the scope a u64 digest of the tenant scope (its name kept beside it), the
  block its full 32-byte hash. A namespace registered again after a restart finds its blocks.
- **Write-through at commit**: every block that becomes READY (a runner's
  Commit, a peer fetch) is offered to the tier, so a restart keeps every block
  that had time to reach the disk, not only those memory had to evict. Blocks
  promoted *from* the disk are not offered back (`promoting`).
- **Never on Commit's path**: `stored` only queues (slot, generation) per
  block, at most `PENDING_PER_QUEUED` x ``disk_queue_blocks`` (beyond it:
  skipped, counted). Later steps of the loop take slices of `DRAIN_BYTES`,
  only while the tier's queue has room; the copies themselves run in a
  worker thread, never on the loop. A slot's stamp (`BlockTable.stamp_of`,
  the node's record) is checked before and after its copy, on the loop (a
  seqlock): a block evicted and its slot reused before or during its copy is
  skipped and counted (``moved``), never written under another block's key.
- **One copy**: the worker copies the slot straight into the tier's aligned
  buffer (`DiskTier.reserve_write`, `BlockPool.read_into`: a memcpy from a
  host pool, a device-to-host ``cudaMemcpy`` from a CUDA pool), then the loop
  submits or cancels it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.errors import KVStoreError
from kvstore.events import CacheEvent, EventKind
from kvstore.layout import NamespaceSpec
from kvstore.pool.base import BlockPool
from kvstore.results import BlockRef
from kvstore.stamps import stamp_ident
from kvstore.types import BlockHash, NamespaceId, TenantId
from service.cluster.local import LocalNode
from service.config import Config
from service.disk.holdings import DiskNames
from service.disk.jobs import PendingWrite
from service.disk.tier import DiskKey, DiskStats, DiskTier, DiskTierError

log = logging.getLogger(__name__)

DRAIN_BYTES = 4 << 20
"""Bytes handed to the copying thread per step of the loop (the copies ran on the loop
before: 0.3 ms per 512 KiB here); a step now costs the loop only the bookkeeping."""

ROOM_WAIT = 0.002
"""Seconds the copies wait when the tier's queue is full (its writes free room)."""

PENDING_PER_QUEUED = 16
"""Committed blocks the node keeps waiting for the tier, per block of its queue: a
reference to the slot each, no copy (a Commit of a long prompt is thousands of
blocks at once; the tier's queue holds copies, so it is the small one)."""

SKIP_REASONS = ("backlog", "moved", "dropped", "error")
"""Why a committed block was not offered: the node's queue was full; its slot was
reused before its turn; its namespace was dropped; the copy out of its pool failed."""


@functools.lru_cache(maxsize=256)
def pending_limit(config: Config) -> int:
    """Committed blocks waiting for the tier beyond which the node skips them."""
    return PENDING_PER_QUEUED * config.disk_queue_blocks


def namespace_key(spec: NamespaceSpec) -> bytes:
    """The 16-byte disk digest of a namespace: stable across restarts and nodes."""
    return spec.digest()[:16]


@functools.lru_cache(maxsize=4096)
def scope_key(scope: TenantId) -> int:
    """The u64 a tenant scope is keyed by on disk (the shared scope included)."""
    digest = hashlib.blake2b(scope.encode(), digest_size=8, person=b"kvstore-scope").digest()
    return int.from_bytes(digest, "little")


def scope_name_of(scope: TenantId) -> bytes:
    """The tenant scope's name as a slot header keeps it (`DiskKey.scope_name`): tenant
    names are 1-128 ASCII characters (`service.tenancy`), so it always fits."""
    return scope.encode()


def lock_tier_file(path: str) -> tuple[int, bool]:
    """Take the tier file's lock (``flock``, exclusive), creating the file if missing.

    Two nodes on one file would each believe they own its slots and overwrite
    each other's blocks; the second one stops at start instead. The lock goes
    with the process (a SIGKILLed node holds it no more).

    Returns:
        (the descriptor that holds the lock, whether the file was created here).

    Raises:
        DiskTierError: another process holds the lock, or the file cannot be opened.
    """
    created = not os.path.exists(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise DiskTierError(
            f"disk_path {path}: cannot be opened ({exc.strerror}); "
            "give the node's user write access to it and its folder, or set another disk_path"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DiskTierError(
            f"disk_path {path}: another kvstore-server uses this file (it holds its lock); "
            "stop that node or give each node its own disk_path"
        ) from None
    return fd, created


@dataclass(frozen=True, slots=True)
class _Write:
    """A committed block waiting for its copy to the tier."""

    namespace: NamespaceId
    key: DiskKey
    ref: BlockRef
    """Its slot and READY generation when it was committed."""


class NodeDisk:
    """The node's disk tier: opened at start, fed at commit, flushed at a clean stop."""

    def __init__(self, tier: DiskTier, config: Config, lock_fd: int | None = None) -> None:
        """Wrap an open tier; use `open`."""
        self.tier = tier
        self._lock_fd = lock_fd
        self.config = config
        self.node: LocalNode | None = None
        """The node whose pools the blocks are copied out of (`attach`)."""
        self.promoting: set[DiskKey] = set()
        """Blocks being committed by a promotion from disk: not offered back."""
        self.promotions: set[asyncio.Task[int]] = set()
        """Promotions from disk under way (`service.disk.promote`): ended before the tier."""
        self.skipped: Counter[str] = Counter({reason: 0 for reason in SKIP_REASONS})
        """Committed blocks not offered, per reason (`SKIP_REASONS`)."""
        self.offered = 0
        """Blocks handed to the tier (it may still drop them: `DiskStats.write_drops`)."""
        self._pending: collections.deque[_Write] = collections.deque()
        self._draining: asyncio.Handle | None = None
        self._copies: set[asyncio.Future[None]] = set()
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._stopped = False
        self.names = DiskNames(tier.scope_names)
        """The tier's keys back to namespace ids and tenant scopes."""
        self.on_events: Callable[[list[CacheEvent]], None] | None = None
        """Takes the tier's stored and removed blocks as the node names them (the node
        publishes them with the disk medium); None: they are dropped."""
        self._publishing: asyncio.Handle | None = None

    @classmethod
    def open(cls, config: Config) -> NodeDisk | None:
        """Open (or create) the tier file of ``disk_path``; None when it is not set.

        Blocking (preallocation, index rebuild): called once at start, before
        any port is bound.

        Raises:
            DiskTierError: an `OSError` of one line naming the setting and the fix.
        """
        if not config.disk_path:
            return None
        lock_fd, created = lock_tier_file(config.disk_path)
        try:
            tier = DiskTier.open(
                config.disk_path,
                config.disk_capacity_bytes,
                queue_blocks=config.disk_queue_blocks,
                io_threads=config.disk_io_threads,
                direct=config.disk_direct_io,
            )
        except BaseException:
            if created:  # made here (under our lock) and never became a tier file
                os.unlink(config.disk_path)
            os.close(lock_fd)
            raise
        stats = tier.stats()
        log.info(
            "disk tier %s: %d blocks found in %.2fs (%d discarded), %d of %d bytes used",
            config.disk_path,
            stats.rebuilt_blocks,
            stats.rebuild_seconds,
            stats.discarded_at_open,
            stats.used_bytes,
            stats.capacity_bytes,
        )
        return cls(tier, config, lock_fd)

    def attach(self, node: LocalNode) -> None:
        """Name the node whose pools blocks are copied out of (once)."""
        assert self.node is None, "bug: NodeDisk.attach called twice"
        self.node = node
        self.tier.events.listener = self._events_waiting

    # --- the tier's blocks, named ---------------------------------------------------

    def _events_waiting(self) -> None:
        """The tier has events: publish them in the loop's next step (one per step)."""
        if self._publishing is None:
            self._publishing = asyncio.get_running_loop().call_soon(self.publish_events)

    def publish_events(self) -> None:
        """Hand the tier's events to `on_events` as `CacheEvent`s; call on the loop."""
        if self._publishing is not None:
            self._publishing.cancel()
            self._publishing = None
        events = self.tier.take_events()
        if not events or self.node is None:
            return
        self._learn_namespaces()
        named = self.names.cache_events(events, self.node.now())
        if named and self.on_events is not None:
            self.on_events(named)

    def _learn_namespaces(self) -> None:
        assert self.node is not None
        for table in self.node.store.tables():
            self.names.learn(namespace_key(table.spec), table.spec)

    def registered(self, spec: NamespaceSpec) -> None:
        """A namespace is registered: publish what the disk holds of it (as stored)."""
        key = namespace_key(spec)
        self.names.learn(key, spec)
        if self.on_events is None or self.node is None:
            return
        by_scope: dict[int, list[BlockHash]] = {}
        for _, digest, block_hash in self.tier.keys_of(key):
            by_scope.setdefault(digest, []).append(BlockHash(block_hash))
        events: list[CacheEvent] = []
        now = self.node.now()  # the events' time (the cluster stream's `at`)
        for digest, hashes in by_scope.items():
            scope = self.names.scope(digest)
            if scope is not None:
                kind = EventKind.STORED
                events.append(CacheEvent(kind, spec.namespace_id, scope, tuple(hashes), at=now))
        if events:
            self.on_events(events)

    def members(self) -> dict[NamespaceId, list[bytes]]:
        """Every block on disk of every registered namespace as a directory member."""
        assert self.node is not None
        out: dict[NamespaceId, list[bytes]] = {}
        for table in self.node.store.tables():
            key = namespace_key(table.spec)
            self.names.learn(key, table.spec)
            out[table.namespace] = self.names.members(self.tier.keys_of(key))
        return out

    def key(self, spec: NamespaceSpec, scope: TenantId, block_hash: BlockHash) -> DiskKey:
        """The disk key of one block of a namespace and scope."""
        return DiskKey(namespace_key(spec), scope_key(scope), block_hash, scope_name_of(scope))

    def run_after(
        self, spec: NamespaceSpec, scope: TenantId, chain: Sequence[BlockHash], have: int
    ) -> int:
        """How many blocks of ``chain`` after the first ``have`` are on disk (index only)."""
        hashes = chain[have:]
        return self.tier.run_length(namespace_key(spec), scope_key(scope), hashes) if hashes else 0

    # --- write-behind -----------------------------------------------------------------

    def stored(self, events: list[CacheEvent]) -> None:
        """Queue the blocks the store's STORED events name for the tier; call on the loop.

        Only bookkeeping here (a Commit's reply is not delayed by a copy): the
        copies run in later steps of the loop (`_drain`).
        """
        node = self.node
        if node is None or self._stopped:
            return
        limit = pending_limit(self.config)
        for event in events:
            if event.kind is not EventKind.STORED:
                continue
            try:
                table = node.table(event.namespace)
            except KVStoreError:
                continue  # dropped meanwhile
            ns_key, scope = namespace_key(table.spec), scope_key(event.scope)
            name = scope_name_of(event.scope)
            for block_hash in event.hashes:
                key = DiskKey(ns_key, scope, block_hash, name)
                if key in self.promoting:
                    continue  # read from the disk just now: it is there
                ref = table.ready_ref(event.scope, block_hash)
                if ref is None:
                    self.skipped["moved"] += 1
                elif len(self._pending) >= limit:
                    self.skipped["backlog"] += 1
                else:
                    self._pending.append(_Write(event.namespace, key, ref))
        if self._pending and self._draining is None:
            self._draining = asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self, budget: int = DRAIN_BYTES, *, again: bool = True) -> None:
        """Offer queued blocks while the tier's queue has room, about ``budget`` bytes,
        then yield the loop to others (``again``: schedule the next step)."""
        self._draining = None
        node = self.node
        assert node is not None, "bug: a drain without a node"
        stats = self.tier.stats()
        room = stats.queue_blocks - stats.queue_depth
        writes: list[tuple[_Write, BlockPool, PendingWrite]] = []
        while self._pending and budget > 0 and (room > 0 or stats.degraded):
            write = self._pending.popleft()
            try:
                table = node.table(write.namespace)
                pool = node.pool(write.namespace)
            except KVStoreError:
                self.skipped["dropped"] += 1
                continue
            ref = write.ref
            if table.stamp_of(ref.slot) != (ref.generation, stamp_ident(ref.hash)):
                self.skipped["moved"] += 1  # evicted and reused before its turn
                continue
            size = pool.descriptor.block_bytes
            budget -= size
            room -= 1
            pending = self.tier.reserve_write(write.key, size, ref.checksum)
            self.offered += 1
            if pending is not None:  # else refused, and counted, by the tier
                writes.append((write, pool, pending))
        if writes:
            self._copy_then_write(writes)
        if self._pending and again:
            loop = asyncio.get_running_loop()
            if room > 0 or stats.degraded:
                self._draining = loop.call_soon(self._drain)
            else:  # the disk is behind: wait for its queue, the commits do not
                self._draining = loop.call_later(ROOM_WAIT, self._drain)

    def _copy_then_write(self, writes: list[tuple[_Write, BlockPool, PendingWrite]]) -> None:
        """Copy slots into the tier's buffers in a worker thread, then write the intact."""
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, "kvstore-disk-copy")

        def copy() -> list[bool]:
            copied = []
            for write, pool, pending in writes:
                try:  # a host pool's copy lets go of the GIL, a CUDA one waits on the device
                    pool.read_into(write.ref.slot, pending.payload)
                    copied.append(True)
                except Exception:  # the pool closed (namespace dropped): skipped
                    copied.append(False)
            return copied

        async def copy_then_write() -> None:
            done = asyncio.get_running_loop().run_in_executor(self._thread, copy)
            try:
                copied = await asyncio.shield(done)
            except BaseException:
                # Cancelled (a stop): the thread may still be copying into the buffers.
                with contextlib.suppress(BaseException):
                    await done
                for _, _, pending in writes:
                    self.tier.cancel_write(pending)
                raise
            for (write, _, pending), ok in zip(writes, copied, strict=True):
                # The stamp again, after the copy (a seqlock): a slot reused meanwhile is torn.
                if ok and self._intact(write):
                    self.tier.submit_write(pending)
                    continue
                self.skipped["moved" if ok else "error"] += 1
                self.tier.cancel_write(pending)

        task = asyncio.ensure_future(copy_then_write())
        self._copies.add(task)
        task.add_done_callback(self._copies.discard)

    def _intact(self, write: _Write) -> bool:
        """Whether a block's slot still carries the stamp it was committed with."""
        assert self.node is not None
        try:
            table = self.node.table(write.namespace)
        except KVStoreError:
            return False
        ref = write.ref
        return table.stamp_of(ref.slot) == (ref.generation, stamp_ident(ref.hash))

    # --- namespaces, stop -------------------------------------------------------------

    def drop(self, spec: NamespaceSpec) -> int:
        """Forget every block of a dropped namespace on disk; returns how many."""
        key = namespace_key(spec)
        self.names.learn(key, spec)  # the table is gone: name its blocks' removal
        dropped = self.tier.drop_namespace(key)
        self.publish_events()
        self.names.forget(key)
        log.info("namespace %s: %d blocks dropped from the disk tier", spec.namespace_id, dropped)
        return dropped

    def stats(self) -> DiskStats:
        """The tier's snapshot; call on the loop."""
        return self.tier.stats()

    async def stop(self, flush_seconds: float) -> None:
        """Offer what is queued, wait up to ``flush_seconds`` for the writes, close the tier.

        A clean stop keeps every block committed before it whose write fits in
        ``timeout`` (``disk_flush_seconds``); the rest is lost, never torn (the
        tier's slot headers say which blocks are whole).
        """
        if self._stopped:
            return
        self._stopped = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + flush_seconds
        for promotion in list(self.promotions):  # a cancelled read waits for its thread
            promotion.cancel()
        if self.promotions:
            await asyncio.wait(set(self.promotions), timeout=flush_seconds)
        if self._draining is not None:
            self._draining.cancel()
            self._draining = None
        while self._pending and loop.time() < deadline:
            self._drain(budget=1 << 62, again=False)
            if self._pending:
                await asyncio.sleep(ROOM_WAIT)
        self.skipped["backlog"] += len(self._pending)  # no time left for them
        self._pending.clear()
        if self._copies:
            await asyncio.wait(set(self._copies), timeout=max(0.0, deadline - loop.time()))
        flushed = await self.tier.flush(max(0.0, deadline - loop.time()))
        if not flushed:
            stats = self.tier.stats()
            log.warning(
                "disk tier: %d queued writes did not finish within %.1fs (disk_flush_seconds): "
                "lost, the blocks on disk are whole",
                stats.queue_depth,
                flush_seconds,
            )
        await self.tier.close()
        if self._lock_fd is not None:  # the file is free for the next node
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
        copies = list(self._copies)
        for copy in copies:
            copy.cancel()
        await asyncio.gather(*copies, return_exceptions=True)
