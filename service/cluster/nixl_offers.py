"""The holder's side of peer fetch over NIXL: offers of blocks, checked when they end.

`OfferBlocks` looks the chain up in the tenant's scope (a peek, as
FetchBlocks does: no hit statistics, no LRU refresh) and answers with its
agent's name (and metadata when the reader's copy is stale) and each hit's
(address, length) in its registered pool memory, from ``skip`` on. It
remembers each offered block's slot and generation.

**Checked, not pinned.** The reader READs the bytes, then ends the offer
(`EndOffer`) *before* it commits anything; the answer is how many leading
offered blocks still carry the READY stamp they were offered with (the
slot's generation and the hash's ident, `Store.stamp_intact`: what a local
runner checks in the stamp table). A slot's stamp moves on before the slot
is freed, reused or handed to a writer, and generations never repeat in
the node's life (not even across a namespace dropped and registered again),
so a block still intact at the end was intact for the whole READ, and its
bytes were the block's bytes: the reader commits exactly those, and drops
the rest (a miss, never wrong KV). A WRITING slot's stamp has no ident: it
is never intact. Pins would also have guaranteed the bytes, but a pin
moves its blocks in the LRU when it is released, so a peer's read would
refresh the holder's cache, which FetchBlocks is careful never to do (its
peek leaves no trace; docs/cluster.md); and a peer could hold blocks
unevictable for as long as it keeps asking. The cost of checking instead:
a block evicted during a READ (the holder under memory pressure) was moved
for nothing.

While offers are open, a `ProgressPump` thread advances UCX (NIXL's own
progress thread is off: see `service.cluster.nixl_agent`); it stops with
the last offer, or when the last one's hold runs out. An offer never
ended is forgotten `hold` seconds after it was made; ending it later says 0
intact. Offers open at once are bounded (`MAX_OPEN_OFFERS`); beyond that,
and for a chain whose blocks are not all in registered memory, the answer
is an error, and the reader streams over gRPC.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import FailedPrecondition, LimitExceeded
from kvstore.results import BlockRef
from kvstore.types import BlockHash, NamespaceId, TenantId
from kvstore.v1 import kvstore_pb2 as pb
from service.cluster.local import LocalNode
from service.cluster.nixl_agent import MEM_TYPE, NixlAgent, ProgressPump

MAX_OPEN_OFFERS = 64
"""Offers open at once; more are refused (the reader then streams over gRPC)."""

HOLD_MARGIN_SECONDS = 1.0
"""An offer is remembered this much longer than the reader's fetch timeout."""


@dataclass(frozen=True, slots=True)
class _Offer:
    namespace: NamespaceId
    tenant: TenantId
    refs: list[BlockRef]
    expires_at: float


class OfferBook:
    """The offers this node made and has not seen ended."""

    def __init__(self, node: LocalNode, agent: NixlAgent) -> None:
        """Offer blocks of ``node``'s pools through ``agent``."""
        self.node = node
        self.agent = agent
        self._open: dict[int, _Offer] = {}
        self._pump = ProgressPump(agent)
        self.hold = node.config.peer_fetch_timeout + HOLD_MARGIN_SECONDS
        """Seconds an offer is remembered unless ended."""

    def __len__(self) -> int:
        """Offers open now."""
        return len(self._open)

    def offer(
        self,
        namespace: NamespaceId,
        tenant: TenantId,
        chain: Sequence[BlockHash],
        skip: int,
        known_agent: str,
        known_version: int,
    ) -> pb.OfferBlocksResponse:
        """Describe where the bytes of ``chain[skip:]``'s READY prefix are.

        Nothing held: an answer with ``offer_id`` 0 and no blocks.

        Raises:
            LimitExceeded: too many offers open.
            FailedPrecondition: a block lies outside NIXL-registered memory.
        """
        node = self.node
        now = node.now()
        self._prune(now)
        if len(self._open) >= MAX_OPEN_OFFERS:
            raise LimitExceeded(f"{MAX_OPEN_OFFERS} NIXL offers are open: use FetchBlocks")
        # A peek: a peer's read is not the tenant's use of this node's cache.
        result = node.store.lookup(namespace, tenant, chain, now, peek=True)
        refs = list(result.blocks[skip:])
        if not refs:
            return pb.OfferBlocksResponse()
        pool = node.pool(namespace)
        blocks = []
        for ref in refs:
            place = self.agent.slot_address(namespace, pool, ref.slot)
            if place is None:
                raise FailedPrecondition("the blocks are not in NIXL-registered memory")
            blocks.append(
                pb.OfferedBlock(
                    hash=ref.hash,
                    address=place.address,
                    length=pool.descriptor.block_bytes,
                    arena=place.arena,
                    checksum=ref.checksum,
                )
            )
        offer_id = secrets.randbits(63) | 1
        self._open[offer_id] = _Offer(namespace, tenant, refs, now + self.hold)
        self._pump.run_until(time.monotonic() + self.hold)
        agent = self.agent
        current = known_agent == agent.name and known_version == agent.metadata_version
        return pb.OfferBlocksResponse(
            offer_id=offer_id,
            agent_name=agent.name,
            agent_metadata=b"" if current else agent.metadata(),
            metadata_version=agent.metadata_version,
            mem_type=MEM_TYPE,
            blocks=blocks,
            hold_ms=int(self.hold * 1000),
        )

    def end(self, offer_id: int) -> int:
        """Forget an offer; returns how many leading offered blocks are still intact.

        0 for an unknown offer (ended already, or forgotten after its hold).
        """
        offer = self._open.pop(offer_id, None)
        if not self._open:
            self._pump.stop()
        if offer is None:
            return 0
        intact = 0
        store = self.node.store
        for ref in offer.refs:
            # The READY stamp it was offered with: evicted, reused, handed to
            # a writer, or its namespace dropped (and registered again) all
            # moved it on.
            if not store.stamp_intact(offer.namespace, ref):
                break
            intact += 1
        return intact

    def close(self) -> None:
        """Forget every open offer (shutdown)."""
        self._open.clear()
        self._pump.stop()

    def _prune(self, now: float) -> None:
        """Forget offers whose hold ran out."""
        for offer_id in [i for i, o in self._open.items() if o.expires_at <= now]:
            del self._open[offer_id]
