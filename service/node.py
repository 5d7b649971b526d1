"""The state of one cache node that every servicer method works on.

`Node` bundles the store, the pools, tenancy, events, metrics and the clock.
It is driven from the server's event loop only (the store has no lock); the
one exception is `snapshot`, which the metrics thread calls and which hops
onto the loop to read the store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import kvstore
from kvstore.api.wire import EVENT_TIER_DISK, EVENT_TIER_MEMORY
from kvstore.block_table import BlockTable
from kvstore.errors import UnknownNamespace
from kvstore.events import CacheEvent
from kvstore.layout import NamespaceSpec
from kvstore.limits import StoreLimits
from kvstore.ops.plural import plural
from kvstore.pool.base import BlockPool
from kvstore.results import ExpiryReport, LookupResult, NamespaceStats
from kvstore.store import DropReport, Store, StoreStats
from kvstore.types import BlockHash, LeaseId, NamespaceId, TenantId
from kvstore.v1 import kvstore_pb2 as pb
from service.api import translate
from service.cluster.agent import RedisAgent
from service.cluster.lookup import LookupCall, lookup
from service.cluster.nixl_transport import NixlTransport
from service.cluster.peer_fetch import PeerFetcher
from service.config import Config, ConfigError
from service.disk.holdings import DISK_MEDIUM
from service.disk.node_tier import NodeDisk
from service.disk.promote import DiskPromoter
from service.disk.wiring import disk_stats, start_disk
from service.memory.budget import PoolManager
from service.memory.policy import NamespaceMemory
from service.ops.metrics import Metrics
from service.ops.watch_hub import WatchHub
from service.tenancy.access import TenantAccess
from service.tenancy.callers import ChainRoots, TenantResolver
from service.tenancy.tenants import TenantDirectory, TenantsFileError
from service.vllm_events.engine_index import ChainStart, EngineIndex
from service.vllm_events.metrics import EventsCollector
from service.vllm_events.wiring import KvEvents

log = logging.getLogger(__name__)

T = TypeVar("T")

Clock = Callable[[], float]
"""Monotonic seconds; injectable so tests can move time."""


class Node(TenantAccess):
    """Store + pools + tenancy + events + metrics of one cache node."""

    def __init__(
        self,
        config: Config,
        *,
        clock: Clock = time.monotonic,
        wall: Clock = time.time,
        epoch: int | None = None,
    ) -> None:
        """Build the node's state; ``config`` must be resolved (`service.config.resolve`)."""
        self.config = config
        self.clock = clock
        self.wall = wall
        self.node_id = config.node_id
        self.version = kvstore.__version__
        try:
            directory = TenantDirectory.load(config.tenants_file) if config.tenants_file else None
        except TenantsFileError as exc:
            raise ConfigError(str(exc)) from None
        self.directory = directory
        """Tenant tokens and policies; None = auth off (trust mode, docs/security.md)."""
        labels = config.max_tenant_labels
        if directory is not None and labels:  # the tenants file bounds the names: keep them all
            labels = max(labels, len(directory.policies))
        self.store = Store(
            StoreLimits(
                max_chain_blocks=config.max_chain_blocks,
                max_lease_ttl=config.lease_ttl_max,
                max_namespaces=config.max_namespaces,
                max_pins_per_lease=config.max_pins_per_lease,
                max_leases_per_tenant=config.max_leases_per_tenant,
                write_quarantine=config.write_quarantine_seconds,
                max_tenant_counters=labels,
            ),
            max_leases_of=directory.max_leases if directory is not None else None,
        )
        self.pools = PoolManager(config, epoch)
        self.tenants = TenantResolver(directory=directory, admin_token=config.admin_token)
        self.roots = ChainRoots(config.salt_secret)
        self.events: WatchHub[pb.Event] = WatchHub()
        self.loop: asyncio.AbstractEventLoop | None = None
        """The loop that drives the store; set by the server when it starts."""
        self.metrics = Metrics(self.snapshot, max_tenant_labels=labels)
        self.cluster: RedisAgent | None = None
        """The node's Redis agent when `redis_url` is set (`join_cluster`)."""
        self.peers: PeerFetcher | None = None
        """Fetches missed blocks from peers; set with `cluster`."""
        self.nixl: NixlTransport | None = None
        """NIXL, the data plane of peer fetch (`peer_transport`); set with `cluster`."""
        self.started = clock()
        self.memory = NamespaceMemory(
            self.pools,
            self.store,
            self.now,
            self.publish_events,
            headroom_bytes=config.pool_headroom_bytes,
        )
        """Arenas in and out of namespace pools (growth, give-back, drop)."""
        self.engine_index: EngineIndex | None = (
            EngineIndex(config.engine_kv_events, self._chain_start, config.engine_max_blocks)
            if config.engine_kv_events
            else None
        )
        """Blocks the engines in `engine_kv_events` hold (docs/events.md); None without any."""
        self.kv_events = KvEvents(config, self.engine_index, self._block_size_of, wall)
        """vLLM KV events: the node's own, published; its engines', ingested (`start`ed)."""
        self.metrics.registry.register(
            EventsCollector(lambda: self.on_loop(self.kv_events.figures))
        )
        self.disk = NodeDisk.open(config)  # last: nothing above needs closing if it raises
        """The disk tier below the pools (`disk_path`, docs/disk.md); None = memory only."""
        self.promoter: DiskPromoter | None = (
            start_disk(self, self.disk, self.metrics.registry, self.on_loop) if self.disk else None
        )
        """Reads the blocks a lookup missed back from disk (with `disk`)."""
        if self.disk is not None:
            self.disk.on_events = self.publish_disk_events

    @property
    def epoch(self) -> int:
        """The pool epoch: random per server start."""
        return self.pools.epoch

    def now(self) -> float:
        """The store's notion of now (monotonic seconds)."""
        return self.clock()

    def to_unix(self, t: float) -> float:
        """Unix seconds of a store time."""
        return self.wall() - (self.clock() - t)

    def stats_response(
        self, visible: Callable[[NamespaceStats], NamespaceStats | None] | None = None
    ) -> pb.StatsResponse:
        """The node's StatsResponse; call on the loop.

        Args:
            visible: what one caller may see of each namespace (None drops
                it); every namespace in full when not given (admin, web page).
        """
        stats = self.store.stats()
        namespaces = []
        for full in stats.namespaces:
            ns = visible(full) if visible is not None else full
            if ns is None:
                continue
            table = self.table(ns.namespace)
            namespaces.append(translate.namespace_stats(ns, table.spec.layout, table.shared))
        return pb.StatsResponse(
            node_id=self.node_id,
            version=self.version,
            pool_kind=self.pools.kind,
            pool_epoch=self.epoch,
            uptime_seconds=self.now() - self.started,
            leases=stats.leases,
            leases_expired=stats.leases_expired,
            pinned=stats.pinned_by_leases,
            writing=stats.writing_by_leases,
            namespaces=namespaces,
            capacity_bytes=self.pools.capacity_bytes,
            allocated_bytes=self.pools.allocated_bytes,
            disk=disk_stats(self.disk, self.promoter) if self.disk and self.promoter else None,
        )

    # --- cluster ----------------------------------------------------------------

    async def join_cluster(self, address: str) -> None:
        """Start the Redis agent and the peer fetcher when `redis_url` is set (else nothing).

        Args:
            address: this node's gRPC address, advertised to peers unless
                `advertise_address` is set.
        """
        if not self.config.redis_url:
            return
        self.nixl = NixlTransport.start(self)
        agent = RedisAgent(self, self.config.advertise_address or address)
        self.cluster = agent
        self.peers = PeerFetcher(self, agent.locate, self.nixl.puller if self.nixl else None)
        await agent.start()

    async def leave_cluster(self) -> None:
        """Leave the cluster (registry, directory) and close peer channels; idempotent."""
        agent, peers, nixl = self.cluster, self.peers, self.nixl
        self.cluster = self.peers = None
        self.nixl = None
        if peers is not None:
            await peers.close()
        if nixl is not None:
            await nixl.close()
        if agent is not None:
            await agent.stop()

    # --- namespaces -------------------------------------------------------------

    async def register(self, spec: NamespaceSpec, requested_bytes: int) -> tuple[BlockTable, bool]:
        """The namespace's table, creating it and its pool (one arena and the headroom) if new.

        Returns:
            (table, created).
        """
        async with self.memory.lock:
            # Same spec: idempotent; another layout: LayoutConflict. Checked
            # before any pool memory is allocated.
            existing = self.store.existing_namespace(spec)
            if existing is not None:
                return existing, False
            table = await self.memory.create(
                spec.namespace_id,
                spec.layout.block_bytes,
                requested_bytes,
                lambda slots, stamps: self.store.register_namespace(
                    spec,
                    slots,
                    shared=self.is_shared(spec.model_id),
                    quota=self.quota_of if self.directory is not None else None,
                    stamps=stamps,
                ),
            )
            if self.disk is not None:  # what the disk holds of it is this node's too
                self.disk.registered(spec)
            return table, True

    async def make_room(
        self, table: BlockTable, tenant: TenantId, chain: Sequence[BlockHash]
    ) -> None:
        """Grow the namespace's pool before a reserve if it lacks free slots (`NamespaceMemory`)."""
        await self.memory.make_room(table, tenant, chain)

    async def lookup(self, call: LookupCall) -> LookupResult:
        """A Lookup: the longest cached prefix, completed from a peer when allowed.

        The store's lookup runs before the first ``await`` (`service.cluster.lookup`),
        so what the caller applied just before (a carried release) has nothing in
        between. Counts the lookup's hits and misses, in blocks and tokens.
        """
        result = await lookup(self, self.peers, call, self.promoter)
        self.memory.touch(call.namespace)  # a namespace in use gives its arenas back last
        hit_tokens = result.hit_blocks * self.table(call.namespace).block_size
        self.metrics.observe_lookup(
            call.namespace,
            call.tenant,
            hit_blocks=result.hit_blocks,
            miss_blocks=len(call.chain) - result.hit_blocks,
            hit_tokens=hit_tokens,
            miss_tokens=max(0, call.query_tokens - hit_tokens),
        )
        return result

    def commit(
        self,
        namespace: NamespaceId,
        tenant: TenantId,
        lease: LeaseId,
        hashes: Sequence[BlockHash],
        checksums: Sequence[int] | None = None,
    ) -> int:
        """Make written blocks READY (`Store.commit`, with their writer's checksums) and
        publish the events; then keep the pool's headroom (`NamespaceMemory.keep_ahead`:
        after the runner's copy, not during).

        Returns:
            Blocks committed.
        """
        committed = self.store.commit(namespace, tenant, lease, hashes, self.now(), checksums)
        self.publish_events()
        if committed:
            self.memory.keep_ahead(self.store.table(namespace))
        return committed

    def checksum_failed(
        self, namespace: NamespaceId, tier: str, block_hash: BlockHash, holder: str
    ) -> None:
        """Count (``kvstore_checksum_failures_total``) and log a block whose bytes did not
        match its writer's checksum; the caller does not serve or commit it.

        Args:
            namespace: the block's namespace.
            tier: where the bytes came from: "peer" (a peer fetch), "disk" (the disk
                tier) or "local" (this pool).
            block_hash: the block.
            holder: the node that held the bytes (a peer's id, or this node's).
        """
        self.metrics.checksum_failures.labels(namespace, tier).inc()
        log.warning(
            "checksum mismatch: block %s in %s (tier %s, held by %s): not served",
            block_hash.hex()[:16],
            namespace,
            tier,
            holder,
        )

    def drop_corrupt(
        self, namespace: NamespaceId, tenant: TenantId, hashes: Sequence[BlockHash]
    ) -> int:
        """Drop the blocks a runner found corrupt whose slots, checked here, fail too.

        A runner that checked its copy of a hit (`Hit.check_bytes`) reports the
        blocks that failed with its release (``ReleaseRequest.packed_corrupt``);
        without this every later load would recompute them. The node believes
        no one: it hashes each slot itself (a false report drops nothing), counts
        a failure in ``kvstore_checksum_failures_total{tier="local"}`` and drops
        the block unless a pin still holds it (its reader reports it in turn).
        Blocks without a checksum (a CUDA pool's) are never dropped.

        Returns:
            Blocks dropped.
        """
        table = self.store.table(namespace)
        pool = self.pool(namespace)
        scope = table.scope_of(tenant)
        dropped = 0
        for block_hash in dict.fromkeys(hashes):
            ref = table.ready_ref(scope, block_hash)
            if ref is None or not ref.checksum or pool.checksum(ref.slot) == ref.checksum:
                continue
            self.checksum_failed(namespace, "local", block_hash, self.node_id)
            dropped += self.store.drop_corrupt(namespace, tenant, block_hash, self.now())
        if dropped:
            self.publish_events()
        return dropped

    async def drop(self, namespace: NamespaceId, force: bool) -> tuple[DropReport, int]:
        """Drop a namespace (`Store.drop_namespace`) and give its pool back to the budget.

        Returns:
            (what the store removed, bytes returned to the budget).
        """
        spec = self.table(namespace).spec
        report, freed = await self.memory.drop(namespace, force)
        if self.disk is not None:
            self.disk.drop(spec)
        log.info(
            "namespace %s dropped%s: %s removed, %s dropped, %s aborted",
            namespace,
            " by force" if force else "",
            plural(report.removed, "block"),
            plural(report.pins_dropped, "pin"),
            plural(report.writes_aborted, "write"),
        )
        return report, freed

    def table(self, namespace: NamespaceId) -> BlockTable:
        """A registered namespace's table (`UnknownNamespace` otherwise)."""
        return self.store.table(namespace)

    def pool(self, namespace: NamespaceId) -> BlockPool:
        """A registered namespace's pool."""
        self.store.table(namespace)
        return self.pools.get(namespace)

    def root(self, table: BlockTable, tenant: TenantId) -> BlockHash:
        """The chain root of ``table``'s namespace for ``tenant``."""
        return self.roots.root(table.spec, tenant, shared=table.shared)

    # --- events, expiry, snapshots ------------------------------------------------

    def publish_events(self) -> None:
        """Fan out the store's pending events to watchers, the Redis agent and the
        KV-event publisher (queued)."""
        taken = self.store.take_events()
        if self.disk is not None:
            self.disk.stored(taken)  # write-through: queued here, copied in later loop steps
        self._fan_out(taken, EVENT_TIER_MEMORY)

    def publish_disk_events(self, events: list[CacheEvent]) -> None:
        """The disk tier's stored and removed blocks, published as the pool's are (tier
        "disk"; the directory's disk sets; KV events with the disk medium,
        `service.disk.holdings`)."""
        self._fan_out(events, EVENT_TIER_DISK)

    def _fan_out(self, events: list[CacheEvent], tier: str) -> None:
        """``tier``'s block events to watchers, the Redis agent (directory and stream) and
        the KV-event publisher."""
        for ev in events:
            self.events.publish(ev.namespace, translate.event(ev, self.node_id, self.to_unix, tier))
            if self.cluster is not None:
                self.cluster.publish(ev, self.to_unix(ev.at), tier)
        if events:
            self.kv_events.publish(events, DISK_MEDIUM if tier == EVENT_TIER_DISK else None)

    def _block_size_of(self, namespace: NamespaceId) -> int | None:
        """Tokens per block of a namespace (None once it is dropped)."""
        try:
            return self.store.table(namespace).spec.layout.block_size
        except UnknownNamespace:
            return None

    def tables_of_model(self, model_id: str) -> list[BlockTable]:
        """The namespaces ``model_id`` names: those registered with exactly that model id,
        else those vLLM's connector registered for that model (``Qwen/Qwen3-0.6B`` names
        ``vllm:Qwen/Qwen3-0.6B@default#cfg-...``, `kvstore.integrations.vllm.identity`):
        what an operator or a router knows of an engine is the model it serves."""
        tables = [t for t in self.store.tables() if t.spec.model_id == model_id]
        if not tables:
            connector_forms = (f"vllm:{model_id}@", f"vllm:{model_id}#")
            tables = [t for t in self.store.tables() if t.spec.model_id.startswith(connector_forms)]
        return tables

    def _chain_start(self, model_id: str, tenant: str) -> ChainStart | None:
        """How an engine's blocks of ``model_id`` are keyed (`EngineIndex`); None while no
        namespace, or several (dtypes, block sizes, tensor-parallel ranks), answer to it
        (`tables_of_model`)."""
        tables = self.tables_of_model(model_id)
        if len(tables) != 1:
            return None
        table = tables[0]
        scope = table.scope_of(TenantId(tenant))
        return ChainStart(
            table.namespace,
            scope,
            self.root(table, TenantId(tenant)),
            table.spec.layout.block_size,
            table.spec.scheme,
        )

    def expire(self) -> ExpiryReport:
        """End every lease past its deadline; counts them and publishes events."""
        report = self.store.expire(self.now())
        for ended in report.leases:  # their runners' mappings hold no arena any more
            self.pools.held.lease_ended(ended.lease_id)
        if report.leases:
            self.metrics.lease_expiries.inc(len(report.leases))
            log.info(
                "expired %s: %s dropped, %s aborted",
                plural(len(report.leases), "lease"),
                plural(report.pins_dropped, "pin"),
                plural(report.writes_aborted, "write"),
            )
        self.publish_events()
        return report

    def snapshot(self) -> StoreStats | None:
        """A store snapshot; safe from any thread (hops onto the loop when needed)."""
        return self.on_loop(self.store.stats)

    def on_loop(self, read: Callable[[], T]) -> T | None:
        """``read()`` on the loop, from any thread; None when the loop is gone or stuck (5 s)."""
        loop = self.loop
        if loop is None or _on_loop(loop):
            return read()
        if loop.is_closed():
            return None

        async def take() -> T:
            return read()

        future = asyncio.run_coroutine_threadsafe(take(), loop)
        try:
            return future.result(timeout=5)
        except (concurrent.futures.TimeoutError, RuntimeError):
            future.cancel()
            return None


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """True when the store may be read directly: on the loop, or with the loop stopped."""
    if not loop.is_running():
        return True
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
