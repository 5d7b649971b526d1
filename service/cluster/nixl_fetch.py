"""The reader's side of peer fetch over NIXL: one READ straight into reserved slots.

1. Ask the holder for an offer (`OfferBlocks`, with the cluster token): it
   looks ``chain[skip:]``'s READY prefix up in the tenant's scope and names
   each block's (address, length) in its NIXL-registered pool memory, with
   its agent metadata when ours is stale.
2. Contact first, then make room (as the gRPC stream does): only now grow
   the pool if needed, open the internal lease and reserve the missing blocks.
3. One NIXL READ of every wanted block, remote address to our slot (blocks
   adjacent on both sides as one descriptor), waited for in a worker thread
   (the loop stays free) until done or the offer is about to be forgotten.
4. End the offer (`EndOffer`): the holder answers how many leading offered
   blocks are still the very blocks it offered (`service.cluster.nixl_offers`:
   checked, not pinned). Check the intact blocks' bytes, where they landed,
   against the checksums offered with them (the first mismatch and what
   follows are dropped, counted and logged), check our slots are still this
   lease's, commit exactly the intact, verified ones with their checksums,
   close the lease (aborting the rest).

Any failure (an error state, the deadline, the caller's cancellation) aborts
the reservation: a miss, never wrong KV. A transfer that is still in flight
when the fetch gives up is aborted, and its slots stay reserved
(quarantined) until it surely wrote its last byte, so no reused slot is
ever overwritten by a late write. `pull` answers `Pulled`: the blocks
committed, or `FALLBACK` when NIXL is not offered or failed (the caller then
streams the blocks over gRPC).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from kvstore.errors import KVStoreError
from kvstore.types import BlockHash, LeaseId, NamespaceId, SlotId, TenantId
from kvstore.v1 import kvstore_pb2 as pb
from service.cluster.directory import PeerHolder
from service.cluster.fetch_lease import close_fetch_lease, open_fetch_lease, reserve_missing
from service.cluster.local import LocalNode
from service.cluster.nixl_agent import MEM_TYPE, NixlAgent, Place, Transfer, XferState

if TYPE_CHECKING:  # the async stub exists in the generated .pyi only
    from kvstore.v1.kvstore_pb2_grpc import KVStoreAsyncStub

log = logging.getLogger(__name__)

REFUSAL_SECONDS = 30.0
"""A holder that offers no NIXL is asked again only after this long (gRPC meanwhile)."""

HOLD_SAFETY_SECONDS = 0.5
"""A READ must be done this long before the holder's pins drop, else it is abandoned."""

QUARANTINE_SECONDS = 1.0
"""Slots of an aborted in-flight READ stay reserved this long after the abort."""

END_OFFER_TIMEOUT = 2.0
"""Seconds an EndOffer may take (the holder's hold drops the pins anyway)."""

WORKER_STOP_SECONDS = 1.0
"""Seconds a READ's waiter gets to stop once told to (it stops within one poll)."""


@dataclass(frozen=True, slots=True)
class Pulled:
    """What one NIXL pull came to: blocks committed, or a fallback to the gRPC stream."""

    blocks: int
    """Blocks committed (0: the peer no longer holds them, or they changed meanwhile)."""
    fallback: bool = False
    """NIXL was not offered or failed: nothing committed; stream the blocks over gRPC."""


FALLBACK = Pulled(0, fallback=True)
"""NIXL was not offered or failed: the caller streams the blocks over gRPC."""


class NixlPuller:
    """Pulls offered blocks from peers with NIXL READs."""

    def __init__(self, node: LocalNode, agent: NixlAgent) -> None:
        """Write into ``node``'s pools through ``agent``."""
        self.node = node
        self.agent = agent
        self._agents: dict[str, str] = {}
        """Holder address -> the agent name loaded for it."""
        self._refused: dict[str, float] = {}
        """Holder address -> monotonic time until which it is not asked."""
        self._tasks: set[asyncio.Task[object]] = set()
        self.quarantined = 0
        """Leases kept for transfers that were in flight when their fetch gave up, ever."""

    async def pull(
        self,
        stub: KVStoreAsyncStub,
        metadata: tuple[tuple[str, str], ...],
        holder: PeerHolder,
        namespace: NamespaceId,
        tenant: TenantId,
        target: list[BlockHash],
        have: int,
    ) -> Pulled:
        """Copy ``target[have:]`` from ``holder``: the blocks committed, or `FALLBACK`."""
        address = holder.address
        if self._refused.get(address, 0.0) > time.monotonic():
            return FALLBACK
        known = self._agents.get(address, "")
        request = pb.OfferBlocksRequest(
            namespace_id=namespace,
            tenant=tenant,
            hashes=target,
            skip=have,
            known_agent=known,
            known_metadata_version=self.agent.loaded_version(known) if known else 0,
        )
        try:
            offer = await stub.OfferBlocks(
                request, metadata=metadata, timeout=self.node.config.peer_fetch_timeout
            )
        except grpc.RpcError as err:
            code = err.code()
            if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION):
                self._refused[address] = time.monotonic() + REFUSAL_SECONDS
            log.info("peer %s made no NIXL offer (%s): gRPC stream", holder.node_id, code)
            return FALLBACK
        if not offer.offer_id:
            return Pulled(0)  # the peer no longer holds the chain
        ended = False

        async def end_offer() -> int:
            nonlocal ended
            ended = True
            return await self._end_offer(stub, metadata, offer.offer_id)

        try:
            return await self._take(offer, holder, namespace, tenant, target, have, end_offer)
        finally:
            if not ended:  # gave up early: let the holder forget it now
                self._spawn(end_offer())

    async def _take(
        self,
        offer: pb.OfferBlocksResponse,
        holder: PeerHolder,
        namespace: NamespaceId,
        tenant: TenantId,
        target: list[BlockHash],
        have: int,
        end_offer: Callable[[], Awaitable[int]],
    ) -> Pulled:
        """Check the offer, reserve, READ, end the offer, commit; `FALLBACK` when NIXL failed."""
        address = holder.address
        loop = asyncio.get_running_loop()
        deadline = loop.time() + offer.hold_ms / 1000 - HOLD_SAFETY_SECONDS
        node, store = self.node, self.node.store
        pool = node.pool(namespace)
        block_bytes = pool.descriptor.block_bytes
        blocks = list(offer.blocks)
        if (
            offer.mem_type != MEM_TYPE
            or len(blocks) > len(target) - have
            or any(b.hash != h for b, h in zip(blocks, target[have:], strict=False))
            or any(b.length != block_bytes for b in blocks)
        ):
            log.warning("peer at %s made a malformed NIXL offer: gRPC stream", address)
            return FALLBACK
        try:
            self._load(address, offer)
        except Exception as exc:  # nixl's own errors, or a name mismatch
            log.warning("NIXL metadata of the peer at %s did not load (%s)", address, exc)
            return FALLBACK
        chain = target[: have + len(blocks)]
        await node.make_room(node.table(namespace), tenant, chain)  # the peer answered
        lease_id = open_fetch_lease(node, tenant)
        transfer: Transfer | None = None
        try:
            wanted = reserve_missing(node, namespace, tenant, lease_id, chain)
            local: list[Place] = []
            remote: list[Place] = []
            hashes: list[BlockHash] = []
            slots: list[SlotId] = []
            for block in blocks:
                block_hash = BlockHash(block.hash)
                if block_hash not in wanted:
                    continue  # a local hit meanwhile, or another lease writes it
                slot = store.writing_slot(namespace, tenant, lease_id, block_hash, node.now())
                place = self.agent.slot_address(namespace, pool, slot)
                if place is None:
                    return FALLBACK  # our arena is not registered (yet)
                local.append(place)
                remote.append(Place(block.arena, block.address))
                hashes.append(block_hash)
                slots.append(slot)
            if not hashes:
                return Pulled(0)
            try:
                transfer = self.agent.read(offer.agent_name, local, remote, block_bytes)
            except Exception as exc:  # nixl's own errors: e.g. an address it does not know
                log.warning("NIXL refused a READ from %s (%s): gRPC stream", address, exc)
                return FALLBACK
            state = await wait_read(transfer, deadline)
            if state is not XferState.DONE:
                log.info("NIXL READ from %s ended %s: gRPC stream", address, state.name)
                return FALLBACK
            transfer.release()
            # Only blocks the holder still had as offered when the READ was
            # over were read whole; the rest may be anything: not committed.
            intact = {BlockHash(b.hash) for b in blocks[: await end_offer()]}
            good = [h for h in hashes if h in intact]
            good = await self._verified(namespace, holder, blocks, hashes, slots, good)
            # Still this lease's WRITING slots (raises if it expired meanwhile).
            for block_hash in good:
                store.writing_slot(namespace, tenant, lease_id, block_hash, node.now())
            if good:
                offered = {BlockHash(b.hash): b.checksum for b in blocks}
                sums = [offered[h] for h in good]
                store.commit(namespace, tenant, lease_id, good, node.now(), sums)
            if len(good) < len(hashes):
                log.info("%d of %d blocks from %s changed meanwhile: dropped",
                         len(hashes) - len(good), len(hashes), address)  # fmt: skip
            return Pulled(len(good))
        except KVStoreError as exc:
            log.info("NIXL fetch in %s gave up: %s", namespace, exc)
            return Pulled(0)
        finally:
            if transfer is not None and transfer.state() is XferState.PROC:
                self.quarantined += 1
                self._spawn(self._quarantine(transfer, tenant, lease_id))
            else:
                if transfer is not None:
                    transfer.release()
                close_fetch_lease(node, tenant, lease_id)

    async def _verified(
        self,
        namespace: NamespaceId,
        holder: PeerHolder,
        blocks: list[pb.OfferedBlock],
        hashes: list[BlockHash],
        slots: list[SlotId],
        good: list[BlockHash],
    ) -> list[BlockHash]:
        """The leading blocks of ``good`` whose bytes, as they landed, have the offered checksum.

        The first mismatch is counted and logged, and it and every later block
        are dropped (aborted with the lease: a miss). Hashed in a worker thread:
        a long chain is ~1 GB; the slots are our lease's WRITING slots, which
        nobody else touches, and they are checked still ours after this.
        """
        pool = self.node.pool(namespace)
        expected = {BlockHash(b.hash): b.checksum for b in blocks}
        slot_of = dict(zip(hashes, slots, strict=True))
        todo = [(slot_of[h], expected[h]) for h in good]

        def first_bad() -> int:
            for k, (slot, want) in enumerate(todo):
                # A host pool's blocks always carry one: none offered is a failed
                # check there (pool.checksum is never 0).
                if (want or checksummed) and pool.checksum(slot) != want:
                    return k
            return len(todo)

        checksummed = pool.descriptor.checksummed
        checked = checksummed or any(w for _, w in todo)
        bad = await asyncio.to_thread(first_bad) if checked else len(todo)
        if bad < len(good):
            self.node.checksum_failed(namespace, "peer", good[bad], holder.node_id)
        return good[:bad]

    def _load(self, address: str, offer: pb.OfferBlocksResponse) -> None:
        """Make sure the offering agent's current metadata is loaded."""
        name = offer.agent_name
        previous = self._agents.get(address)
        if previous and previous != name:
            self.agent.forget_peer(previous)  # the holder restarted: a new agent
            del self._agents[address]
        if offer.agent_metadata:
            self.agent.load_peer(name, offer.agent_metadata, offer.metadata_version)
        elif self.agent.loaded_version(name) != offer.metadata_version:
            raise ValueError(f"no metadata sent for agent {name}, and ours is stale")
        self._agents[address] = name

    async def _quarantine(self, transfer: Transfer, tenant: TenantId, lease_id: LeaseId) -> None:
        """Keep an abandoned READ's slots reserved until it surely wrote its last byte."""
        node = self.node
        try:
            while not transfer.release():  # NIXL could not abort it: wait for its end
                with contextlib.suppress(KVStoreError):
                    node.store.renew_lease(lease_id, tenant, node.now())
                while transfer.state() is XferState.PROC:
                    await asyncio.sleep(0.1)
                    with contextlib.suppress(KVStoreError):
                        node.store.renew_lease(lease_id, tenant, node.now())
            with contextlib.suppress(KVStoreError):
                node.store.renew_lease(lease_id, tenant, node.now())
            await asyncio.sleep(QUARANTINE_SECONDS)  # aborted: let in-flight bytes land
        finally:
            close_fetch_lease(node, tenant, lease_id)

    async def _end_offer(
        self, stub: KVStoreAsyncStub, metadata: tuple[tuple[str, str], ...], offer_id: int
    ) -> int:
        """End an offer at the holder; how many offered blocks it says are intact (0: error)."""
        try:
            answer = await stub.EndOffer(
                pb.EndOfferRequest(offer_id=offer_id), metadata=metadata, timeout=END_OFFER_TIMEOUT
            )
        except grpc.RpcError as err:
            log.info("EndOffer failed (%s): nothing of the offer is kept", err.code())
            return 0
        return int(answer.intact)

    def _spawn(self, work: Coroutine[object, None, object]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Wait for the background EndOffers and quarantines (bounded), then unload peers."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=END_OFFER_TIMEOUT + QUARANTINE_SECONDS)
        for task in list(self._tasks):
            task.cancel()
        for name in set(self._agents.values()):
            self.agent.forget_peer(name)
        self._agents.clear()


async def wait_read(transfer: Transfer, deadline: float) -> XferState:
    """Wait for a transfer in a worker thread (the loop's timers are too coarse to poll it).

    Returns its end state, ``PROC`` at ``deadline`` (loop time), or ``NEW``
    when it was never posted. However this ends (cancellation too), the
    worker has stopped touching the transfer when it returns (within
    `WORKER_STOP_SECONDS`), so the caller may release it; the loop is never
    blocked meanwhile.
    """
    loop = asyncio.get_running_loop()
    until = time.monotonic() + (deadline - loop.time())
    stop = threading.Event()
    # Shielded: a cancelled wait leaves the worker running until it has seen
    # `stop` (a worker that starts after `stop` was set posts nothing).
    worker = asyncio.ensure_future(asyncio.to_thread(transfer.wait, until, stop))
    try:
        return await asyncio.shield(worker)
    finally:
        stop.set()
        await _stopped(worker)


async def _stopped(worker: asyncio.Future[XferState]) -> None:
    """Await the end of ``worker`` (at most `WORKER_STOP_SECONDS`) without blocking the loop.

    A cancellation that comes meanwhile is held until then and raised after:
    the caller releases the transfer next, which must not race the worker.
    """
    loop = asyncio.get_running_loop()
    until = loop.time() + WORKER_STOP_SECONDS
    cancelled = False
    while not worker.done() and loop.time() < until:
        try:
            await asyncio.wait([worker], timeout=until - loop.time())
        except asyncio.CancelledError:
            cancelled = True
    if not worker.done():
        log.warning("a NIXL READ's waiter did not stop within %g s", WORKER_STOP_SECONDS)
    if cancelled:
        raise asyncio.CancelledError
