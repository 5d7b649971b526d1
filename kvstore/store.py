"""The store: namespaces, leases and events of one cache node.

This is the facade the service calls. It is synchronous and pure: no I/O, no
clock reads (every call that needs time takes ``now``), no randomness (lease
ids are chosen by the caller). One store is driven by one thread or one
event loop at a time; it holds no lock of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstore.block_table import BlockTable
from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    LayoutConflict,
    LimitExceeded,
    UnknownNamespace,
)
from kvstore.events import CacheEvent
from kvstore.layout import NamespaceSpec
from kvstore.lease import Lease, LeaseTable
from kvstore.limits import StoreLimits
from kvstore.results import (
    BlockInfo,
    BlockRef,
    ClearReport,
    ExpiryReport,
    LookupResult,
    NamespaceStats,
    QuotaOf,
    ReleaseReport,
    ReserveResult,
)
from kvstore.stamps import GenerationCounter, StampSink, stamp_ident
from kvstore.types import BlockHash, LeaseId, NamespaceId, SlotId, TenantId


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Node-wide snapshot."""

    namespaces: tuple[NamespaceStats, ...]
    """Per-namespace stats."""
    leases: int
    """Live leases."""
    leases_expired: int
    """Leases ended by expiry since start."""
    pinned_by_leases: int
    """Pins held over all leases (counting repeats)."""
    writing_by_leases: int
    """WRITING blocks held over all leases."""


@dataclass(frozen=True, slots=True)
class DropReport:
    """What `Store.drop_namespace` took down with the namespace."""

    namespace: NamespaceId
    """The namespace dropped."""
    removed: int
    """Resident blocks removed (READY ones, plus WRITING ones aborted by force)."""
    pins_dropped: int
    """Pins taken from leases (only with force)."""
    writes_aborted: int
    """Writes aborted (only with force)."""


class Store:
    """Every namespace's block table plus the node's leases and events."""

    def __init__(
        self, limits: StoreLimits | None = None, *, max_leases_of: QuotaOf | None = None
    ) -> None:
        """Create an empty store.

        Args:
            limits: node-wide bounds.
            max_leases_of: tenant → live leases it may hold, overriding
                ``limits.max_leases_per_tenant`` where it returns nonzero.
        """
        self.limits = limits or StoreLimits()
        self._tables: dict[NamespaceId, BlockTable] = {}
        self._by_model: dict[str, NamespaceSpec] = {}
        self._events: list[CacheEvent] = []
        self._leases = LeaseTable(
            max_ttl=self.limits.max_lease_ttl,
            max_leases_per_tenant=self.limits.max_leases_per_tenant,
            max_leases_of=max_leases_of,
        )
        self._expired_total = 0
        self._generations = GenerationCounter()  # one for every namespace: never repeats

    # --- namespaces -----------------------------------------------------------

    def register_namespace(
        self,
        spec: NamespaceSpec,
        capacity: int,
        *,
        shared: bool = False,
        quota: QuotaOf | None = None,
        stamps: StampSink | None = None,
    ) -> BlockTable:
        """Create a namespace with ``capacity`` slots, or return the existing one.

        Idempotent for an identical spec (the capacity of the first
        registration stays). The same model id with another layout or scheme
        is a `LayoutConflict`: runners of one model must agree on its KV.
        ``quota`` bounds each scope's resident blocks (see `BlockTable`);
        ``stamps`` is where its slot stamps go (its pool's stamp table). Every
        namespace draws generations from the store's one counter.
        """
        existing = self.existing_namespace(spec)
        if existing is not None:
            return existing
        if len(self._tables) >= self.limits.max_namespaces:
            raise LimitExceeded(
                f"this node holds its maximum of {self.limits.max_namespaces} namespaces"
            )
        table = BlockTable(
            spec,
            capacity,
            shared=shared,
            events=self._events,
            max_pins_per_lease=self.limits.max_pins_per_lease,
            quota=quota,
            max_tenant_counters=self.limits.max_tenant_counters,
            generations=self._generations,
            stamps=stamps,
        )
        self._tables[spec.namespace_id] = table
        self._by_model[spec.model_id] = spec
        return table

    def existing_namespace(self, spec: NamespaceSpec) -> BlockTable | None:
        """The table already registered for ``spec``'s model id, if any.

        Lets a caller that must allocate memory for a new namespace find out
        first, without creating anything, whether it exists.

        Raises:
            LayoutConflict: the model id is registered with another spec.
        """
        existing = self._by_model.get(spec.model_id)
        if existing is None:
            return None
        if existing != spec:
            raise LayoutConflict(
                f"model {spec.model_id!r} is registered with {existing.layout} "
                f"scheme {existing.scheme.value}; got {spec.layout} scheme {spec.scheme.value}"
            )
        return self._tables[existing.namespace_id]

    def drop_namespace(self, namespace: NamespaceId, now: float, *, force: bool) -> DropReport:
        """Remove a namespace and every block of it; its id may be registered again.

        Refused (`FailedPrecondition`) while a block is pinned or WRITING,
        unless ``force``: then every lease loses its pins on the namespace
        and its writes there are aborted, as if those leases had expired in
        this namespace only (the leases themselves stay). Emits REMOVED for
        the blocks and CLEARED for the namespace. Cost: O(leases + blocks of
        the namespace); an operator's verb, never on a request path.
        """
        table = self.table(namespace)
        stats = table.stats()
        if (stats.pinned or stats.writing) and not force:
            raise FailedPrecondition(
                f"namespace {namespace} has {stats.pinned} pinned and {stats.writing} WRITING "
                "blocks in use by runners; release them first or drop with force"
            )
        pins = writes = 0
        for lease in list(self._leases):
            if namespace in lease.pins or namespace in lease.writes:
                p, w = table.drop_lease(lease, now)
                lease.forget_pin_sets(namespace)
                pins += p
                writes += w
        removed = table.clear(now).removed
        if len(table):
            raise RuntimeError(f"bug: namespace {namespace} kept {len(table)} blocks after a drop")
        del self._tables[namespace]
        del self._by_model[table.spec.model_id]
        return DropReport(namespace, removed + writes, pins, writes)

    def table(self, namespace: NamespaceId) -> BlockTable:
        """The block table of a namespace, or `UnknownNamespace`."""
        table = self._tables.get(namespace)
        if table is None:
            raise UnknownNamespace(f"namespace {namespace!r} is not registered on this node")
        return table

    def tables(self) -> list[BlockTable]:
        """Every namespace's table, in registration order."""
        return list(self._tables.values())

    # --- leases -----------------------------------------------------------------

    def open_lease(
        self, lease_id: LeaseId, tenant: TenantId, ttl: float, now: float, *, internal: bool = False
    ) -> Lease:
        """Open a lease for ``tenant`` that lives ``ttl`` seconds unless renewed.

        ``internal=True``: the node's own lease (peer fetch), outside the tenant's lease limit.
        """
        return self._leases.open(lease_id, tenant, ttl, now, internal=internal)

    def renew_lease(self, lease_id: LeaseId, tenant: TenantId, now: float) -> Lease:
        """Extend a live lease to ``now + ttl``; `LeaseExpired` once it ended."""
        return self._leases.renew(lease_id, tenant, now)

    def lease(self, lease_id: LeaseId, tenant: TenantId, now: float) -> Lease:
        """A live lease of ``tenant``, or `LeaseExpired` / `UnknownLease`."""
        return self._leases.get(lease_id, tenant, now)

    def close_lease(self, lease_id: LeaseId, tenant: TenantId, now: float) -> ReleaseReport:
        """End a lease now: release its pins and abort its writes.

        Its WRITING slots are freed at once, not quarantined: only the lease's
        owner can close it, and by closing it says it writes no more.
        """
        lease = self._leases.get(lease_id, tenant, now)
        self._leases.remove(lease)
        return self._drop(lease, now)

    def expire(self, now: float) -> ExpiryReport:
        """End every lease whose deadline has passed; O(what they hold).

        The slots the expired leases were writing are quarantined for
        ``limits.write_quarantine`` seconds (the writer may be stalled, not
        dead); quarantined slots whose time has come are freed here too.
        """
        quarantine = self.limits.write_quarantine
        until = now + quarantine if quarantine > 0 else None
        reports = tuple(self._drop(lease, now, until) for lease in self._leases.pop_expired(now))
        self._expired_total += len(reports)
        for table in self._tables.values():
            table.release_quarantined(now)
        return ExpiryReport(reports)

    def next_deadline(self) -> float | None:
        """When the next lease expires, if any (the service sleeps until then)."""
        return self._leases.next_deadline()

    def _drop(
        self, lease: Lease, now: float, quarantine_until: float | None = None
    ) -> ReleaseReport:
        pins = writes = 0
        for namespace in set(lease.pins) | set(lease.writes):
            p, w = self._tables[namespace].drop_lease(lease, now, quarantine_until)
            pins += p
            writes += w
        lease.forget_pin_sets()
        return ReleaseReport(lease.lease_id, lease.tenant, pins, writes)

    # --- block operations ---------------------------------------------------

    def _check_len(self, chain: Sequence[BlockHash]) -> None:
        if len(chain) > self.limits.max_chain_blocks:
            raise InvalidArgument(
                f"a call may name at most {self.limits.max_chain_blocks} blocks, got {len(chain)}"
            )

    def lookup(
        self,
        namespace: NamespaceId,
        tenant: TenantId,
        chain: Sequence[BlockHash],
        now: float,
        *,
        lease_id: LeaseId | None = None,
        query_tokens: int | None = None,
        peek: bool = False,
        release_id: int = 0,
    ) -> LookupResult:
        """Longest READY prefix of ``chain``; pinned under ``lease_id`` if given.

        ``peek=True`` counts nothing and moves nothing in the LRU (see `BlockTable.lookup`).
        A nonzero ``release_id`` (with a lease) names the pins this lookup
        takes: a `release` naming it drops exactly those, once
        (`Lease.pin_sets`). A lookup that pins nothing records nothing.

        Raises:
            InvalidArgument: ``release_id`` without a lease, or already naming
                a live pinned lookup of the lease (`check_release_id`).
        """
        self._check_len(chain)
        table = self.table(namespace)
        lease = self._leases.get(lease_id, tenant, now) if lease_id is not None else None
        if release_id:
            if lease is None:
                raise InvalidArgument("a release id names pins: it needs a pinned lookup")
            lease.declare_pin_set(release_id)
        result = table.lookup(tenant, chain, now, lease=lease, query_tokens=query_tokens, peek=peek)
        if release_id and lease is not None and result.hashes:
            lease.add_pin_set(release_id, namespace, tuple(result.hashes))
        return result

    def check_release_id(
        self, tenant: TenantId, lease_id: LeaseId, release_id: int, now: float
    ) -> None:
        """Raise what `lookup` would for ``release_id``, before anything else is applied.

        Raises:
            InvalidArgument: a live pinned lookup of the lease declared it already.
            LeaseExpired, UnknownLease: as for any use of the lease.
        """
        self._leases.get(lease_id, tenant, now).declare_pin_set(release_id)

    def unpin_lookup(
        self,
        namespace: NamespaceId,
        tenant: TenantId,
        lease_id: LeaseId,
        result: LookupResult,
        now: float,
        release_id: int = 0,
    ) -> int:
        """Undo a pinned lookup whose answer never reached its caller.

        Drops the pins ``result`` took (under ``release_id``'s pin set when
        it declared one) and forgets the id without spending it: the caller
        may declare it again (a retried lookup).
        """
        lease = self._leases.get(lease_id, tenant, now)
        table = self.table(namespace)
        if release_id:
            pin_set = lease.take_pin_set(release_id, namespace)
            if pin_set is None:
                return 0
            return table.release(lease, pin_set.hashes, now)
        return table.release(lease, result.hashes, now)

    def reserve(
        self,
        namespace: NamespaceId,
        tenant: TenantId,
        lease_id: LeaseId,
        chain: Sequence[BlockHash],
        now: float,
    ) -> ReserveResult:
        """Reserve slots for the missing blocks of ``chain`` (see `BlockTable.reserve`)."""
        self._check_len(chain)
        table = self.table(namespace)
        return table.reserve(self._leases.get(lease_id, tenant, now), chain, now)

    def commit(
        self,
        namespace: NamespaceId,
        tenant: TenantId,
        lease_id: LeaseId,
        hashes: Sequence[BlockHash],
        now: float,
        checksums: Sequence[int] | None = None,
    ) -> int:
        """Make written blocks READY, keeping their writer's checksums (see `BlockTable.commit`)."""
        self._check_len(hashes)
        if checksums is not None and len(checksums) != len(hashes):
            raise InvalidArgument(f"{len(checksums)} checksums for {len(hashes)} blocks")
        table = self.table(namespace)
        lease = self._leases.get(lease_id, tenant, now)
        return table.commit(lease, hashes, now, checksums or ())

    def abort(
        self,
        namespace: NamespaceId,
        tenant: TenantId,
        lease_id: LeaseId,
        hashes: Sequence[BlockHash],
        now: float,
    ) -> int:
        """Free reserved blocks that will not be written (see `BlockTable.abort`)."""
        self._check_len(hashes)
        table = self.table(namespace)
        return table.abort(self._leases.get(lease_id, tenant, now), hashes, now)

    def release(
        self,
        namespace: NamespaceId,
        tenant: TenantId,
        lease_id: LeaseId,
        hashes: Sequence[BlockHash],
        now: float,
        release_id: int = 0,
    ) -> int:
        """Drop this lease's pins: those a lookup took, or one per named block.

        With a nonzero ``release_id``: the pins of the lookup that declared it
        (its `PinSet`), exactly once (``hashes`` unused); a spent or undeclared
        id drops nothing and answers the first count while remembered, else 0.
        Without an id: one of this lease's pins per named block.
        """
        self._check_len(hashes)
        table = self.table(namespace)
        lease = self._leases.get(lease_id, tenant, now)
        if not release_id:
            return table.release(lease, hashes, now)
        pin_set = lease.take_pin_set(release_id, namespace)
        if pin_set is None:
            return lease.answered(release_id)
        count = table.release(lease, pin_set.hashes, now)
        lease.remember_answer(release_id, count)
        return count

    def check_slot(self, namespace: NamespaceId, tenant: TenantId, ref: BlockRef) -> None:
        """Raise `StaleSlot` unless ``ref`` still names a resident block."""
        self.table(namespace).check_slot(tenant, ref)

    def stamp_intact(self, namespace: NamespaceId, ref: BlockRef) -> bool:
        """Whether ``ref``'s slot still carries the READY stamp of ``ref``'s block: the
        runners' check after a copy, on the node's record (a WRITING or free slot's
        ident is 0, never a READY block's). False for a namespace that is gone."""
        table = self._tables.get(namespace)
        if table is None or not ref.generation:
            return False
        return table.stamp_of(ref.slot) == (ref.generation, stamp_ident(ref.hash))

    def pinned_slot(
        self, namespace: NamespaceId, tenant: TenantId, lease_id: LeaseId, ref: BlockRef, now: float
    ) -> SlotId:
        """Slot of a block pinned under the lease (see `BlockTable.pinned_slot`)."""
        table = self.table(namespace)
        return table.pinned_slot(self._leases.get(lease_id, tenant, now), ref)

    def writing_slot(
        self,
        namespace: NamespaceId,
        tenant: TenantId,
        lease_id: LeaseId,
        block_hash: BlockHash,
        now: float,
    ) -> SlotId:
        """Slot of a block WRITING under the lease (see `BlockTable.writing_slot`)."""
        table = self.table(namespace)
        return table.writing_slot(self._leases.get(lease_id, tenant, now), block_hash)

    def evict(self, namespace: NamespaceId, n: int, now: float) -> int:
        """Evict up to ``n`` evictable blocks of a namespace."""
        return self.table(namespace).evict(n, now)

    def drop_corrupt(
        self, namespace: NamespaceId, tenant: TenantId, block_hash: BlockHash, now: float
    ) -> bool:
        """Remove a block whose bytes failed their checksum (see `BlockTable.drop_corrupt`)."""
        return self.table(namespace).drop_corrupt(tenant, block_hash, now)

    def clear(self, namespace: NamespaceId, now: float) -> ClearReport:
        """Remove every unpinned READY block of a namespace."""
        return self.table(namespace).clear(now)

    # --- inspection and events ---------------------------------------------

    def iter_blocks(self, namespace: NamespaceId) -> Iterator[BlockInfo]:
        """Snapshot of a namespace's blocks."""
        return self.table(namespace).iter_blocks()

    def stats(self) -> StoreStats:
        """Node-wide snapshot of namespaces and leases."""
        leases = list(self._leases)
        return StoreStats(
            namespaces=tuple(t.stats() for t in self._tables.values()),
            leases=len(leases),
            leases_expired=self._expired_total,
            pinned_by_leases=sum(lease.pin_total for lease in leases),
            writing_by_leases=sum(lease.write_total for lease in leases),
        )

    def take_events(self) -> list[CacheEvent]:
        """Hand over the events accumulated since the last call."""
        events = self._events[:]
        self._events.clear()
        return events
