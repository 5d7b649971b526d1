"""Peer fetch: copy blocks a local lookup missed from a live peer that holds them.

A ``Lookup`` with ``allow_remote`` that stops short of its chain asks the
directory which live peer holds the longest prefix (``locate``, which the
node wires to `RedisAgent.locate`: one round trip). If a peer holds more
than we do, we ask it for the missing blocks (``FetchBlocks``) and, only
once its first block has arrived well-formed (contact first, then make
room), open an internal lease, ``reserve`` the chain up to what the peer
holds (our hits stay hits, the missing blocks become WRITING under the
internal lease), write each block into its slot, commit what arrived, and
close the lease (which aborts whatever did not arrive). Any early exit
cancels the peer's stream at once.
The caller's lookup is then redone against the local store.

- Bounded: at most `peer_fetch_concurrency` fetches run; a lookup that finds
  them all busy is answered from the local cache at once (never queued).
- A peer that vanishes mid-fetch, a Redis outage, a timeout, a size
  mismatch: the blocks that arrived are kept, the rest is a miss, never an
  error of the caller's lookup.
- Checksums: each block's bytes are checked where they landed in our pool
  against the checksum its writer sent (which the holder kept with it,
  `kvstore.checksum`); a mismatch ends the fetch there (that block and the
  rest of the chain are aborted: a miss), is counted in
  ``kvstore_checksum_failures_total{tier="peer"}`` and logged with the
  block, the tier and the holder. A block that comes without a checksum (0:
  a CUDA holder's) fails the check when this pool is a host pool, whose
  blocks always carry one (`PoolDescriptor.checksummed`); a CUDA pool takes
  it unchecked and keeps 0.
- Tenants: the directory is asked with the caller's scope, and the peer
  reads in the tenant's scope, so a fetch only ever copies the caller's
  own tenant's blocks (or a shared namespace's). The internal lease is the
  node's own: it does not count against the tenant's lease limit (the
  fetches, hence such leases, are bounded by `peer_fetch_concurrency`).
- TLS: peer channels use TLS whenever the node serves TLS (`peer_credentials`).
- Transport: with NIXL (`service.cluster.nixl_fetch`) the holder is first
  asked for an offer and the bytes move in one NIXL READ, pool to pool; a
  holder that offers no NIXL, or a READ that fails, falls back to the
  ``FetchBlocks`` stream here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import grpc

from kvstore.errors import KVStoreError
from kvstore.ops.plural import plural
from kvstore.types import BlockHash, LeaseId, NamespaceId, TenantId
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.cluster.directory import PeerHolder
from service.cluster.fetch_lease import close_fetch_lease, open_fetch_lease, reserve_missing
from service.cluster.local import LocalNode
from service.cluster.nixl_fetch import NixlPuller
from service.config import Config, read_setting_file

if TYPE_CHECKING:  # the async stub exists in the generated .pyi only
    from kvstore.v1.kvstore_pb2_grpc import KVStoreAsyncStub

log = logging.getLogger(__name__)

PEER_TOKEN_HEADER = "x-kvstore-peer-token"
"""Metadata key of the cluster token a node presents to a peer's FetchBlocks."""

MAX_HOLDERS_TRIED = 2
"""Peers tried, longest prefix first, before a lookup settles for a miss."""

Locate = Callable[[NamespaceId, TenantId, list[BlockHash]], Awaitable[list[PeerHolder]]]
"""Live peers holding a prefix of a chain in a scope, longest first ([] when unknown)."""


def peer_credentials(config: Config) -> grpc.ChannelCredentials | None:
    """Channel credentials to peers: TLS exactly when this node serves TLS, else None.

    The peer's certificate must chain to `peer_tls_ca`, else to
    `tls_client_ca`, else to the system roots, and name the host of its
    advertised address. The node presents its own `tls_cert` as client
    certificate, so peers that require mutual TLS accept it when it chains
    to their `tls_client_ca` (and allows client auth).

    Raises:
        ConfigError: a file cannot be read.
    """
    if not config.tls_cert:
        return None

    ca = config.peer_tls_ca or config.tls_client_ca
    return grpc.ssl_channel_credentials(
        root_certificates=read_setting_file(
            "peer_tls_ca" if config.peer_tls_ca else "tls_client_ca", ca
        )
        if ca
        else None,
        private_key=read_setting_file("tls_key", config.tls_key),
        certificate_chain=read_setting_file("tls_cert", config.tls_cert),
    )


class PeerFetcher:
    """Copies missing blocks from peers into this node's pools."""

    def __init__(self, node: LocalNode, locate: Locate, nixl: NixlPuller | None = None) -> None:
        """Prepare the fetcher; channels to peers open on first use.

        Args:
            node: the node the fetched blocks are written into.
            locate: asks the directory who holds a chain (`RedisAgent.locate`).
            nixl: pulls blocks with NIXL READs; None: the gRPC stream only.
        """
        self.node = node
        self._locate = locate
        self._nixl = nixl
        self._slots = asyncio.Semaphore(node.config.peer_fetch_concurrency)
        self._channels: dict[str, grpc.aio.Channel] = {}
        token = node.config.cluster_token
        self._metadata: tuple[tuple[str, str], ...] = ((PEER_TOKEN_HEADER, token),) if token else ()
        self._credentials = peer_credentials(node.config)
        self.fetched_blocks = 0
        """Blocks copied from peers, ever."""
        self.failed_fetches = 0
        """Fetches that ended early (peer gone, timeout, mismatch), ever."""
        self.fetches = {"nixl": 0, "grpc": 0}
        """Fetches that brought blocks, per transport, ever."""

    async def fetch(
        self, namespace: NamespaceId, tenant: TenantId, chain: Sequence[BlockHash], have: int
    ) -> int:
        """Copy blocks ``chain[have:]`` from the best peer; returns how many arrived."""
        if have >= len(chain) or self._slots.locked():
            return 0
        async with self._slots:
            try:
                async with asyncio.timeout(self.node.config.peer_fetch_timeout):
                    return await self._fetch(namespace, tenant, list(chain), have)
            except TimeoutError:
                self.failed_fetches += 1
                log.info("peer fetch in %s timed out: served locally", namespace)
                return 0
            except KVStoreError as exc:  # e.g. the namespace went away meanwhile
                self.failed_fetches += 1
                log.info("peer fetch in %s gave up: %s", namespace, exc)
                return 0

    async def _fetch(
        self, namespace: NamespaceId, tenant: TenantId, chain: list[BlockHash], have: int
    ) -> int:
        scope = self.node.table(namespace).scope_of(tenant)
        holders = await self._locate(namespace, scope, chain)
        for holder in holders[:MAX_HOLDERS_TRIED]:
            if holder.blocks <= have or not holder.address:
                break  # longest first: nobody further down has more
            target = chain[: holder.blocks]
            if self._nixl is not None:
                stub = self._stub(holder.address)
                pulled = await self._nixl.pull(
                    stub, self._metadata, holder, namespace, tenant, target, have
                )
                if not pulled.fallback:  # NIXL answered: blocks, or the peer holds none
                    if pulled.blocks:
                        self.fetched_blocks += pulled.blocks
                        self.fetches["nixl"] += 1
                        return pulled.blocks
                    continue
            got = await self._copy(holder, namespace, tenant, target, have)
            if got:
                self.fetches["grpc"] += 1
                return got
        return 0

    async def _copy(
        self,
        holder: PeerHolder,
        namespace: NamespaceId,
        tenant: TenantId,
        target: list[BlockHash],
        have: int,
    ) -> int:
        """Stream ``target[have:]`` from ``holder``; once it answers, reserve, write, commit.

        Contact first, then make room: nothing is reserved (and so nothing
        local evicted) before the peer has sent a well-formed first block, so
        a dead or empty holder costs no other tenant a block.
        """
        node = self.node
        store = node.store
        pool = node.pool(namespace)
        block_bytes = pool.descriptor.block_bytes
        checksummed = pool.descriptor.checksummed
        request = pb.FetchBlocksRequest(
            namespace_id=namespace, tenant=tenant, hashes=target, skip=have
        )
        call = self._stub(holder.address).FetchBlocks(
            request, metadata=self._metadata, timeout=node.config.peer_fetch_timeout
        )
        lease_id: LeaseId | None = None
        written: list[BlockHash] = []
        checksums: list[int] = []
        try:
            try:
                # A block, or grpc.aio.EOF (typed `object`: isinstance tells them apart).
                item = await call.read()
                if not isinstance(item, pb.BlockData):
                    return 0  # the peer no longer holds the chain
                wanted: set[BlockHash] = set()
                while isinstance(item, pb.BlockData):
                    if len(item.data) != block_bytes:
                        self.failed_fetches += 1
                        log.warning("peer %s sent a %d-byte block", holder.node_id, len(item.data))
                        break  # the finally cancels the peer's stream
                    if lease_id is None:
                        # The peer answered: now make room (more arenas, if the budget allows).
                        await node.make_room(node.table(namespace), tenant, target)
                        lease_id = open_fetch_lease(node, tenant)
                        wanted = reserve_missing(node, namespace, tenant, lease_id, target)
                        if not wanted:
                            return 0  # all hits or in flight meanwhile, or no room
                    block_hash = BlockHash(item.hash)
                    if block_hash in wanted:
                        # Checked and written in one synchronous step (no await between).
                        slot = store.writing_slot(
                            namespace, tenant, lease_id, block_hash, node.now()
                        )
                        pool.write(slot, item.data)
                        # Checked where it landed: a torn or misdirected write on
                        # either side, or bytes flipped on the way, is a miss.
                        # A host pool's blocks always carry one: none sent is a
                        # failed check there (pool.checksum is never 0).
                        want = item.checksum
                        if (want or checksummed) and pool.checksum(slot) != want:
                            self.failed_fetches += 1
                            node.checksum_failed(namespace, "peer", block_hash, holder.node_id)
                            break  # this block and the rest stay uncommitted: aborted
                        written.append(block_hash)
                        checksums.append(item.checksum)
                    # else: a local hit meanwhile, or another lease writes it
                    item = await call.read()
            except grpc.RpcError as err:
                self.failed_fetches += 1
                log.info(
                    "peer %s failed mid-fetch (%s): keeping %s",
                    holder.node_id,
                    err.code(),
                    plural(len(written), "block"),
                )
            if written:
                assert lease_id is not None
                store.commit(namespace, tenant, lease_id, written, node.now(), checksums)
                self.fetched_blocks += len(written)
            return len(written)
        finally:
            # An early exit (bad block, error, cancellation) must stop the
            # peer's stream now, not at its deadline; a no-op once it ended.
            call.cancel()
            if lease_id is not None:
                # Runs on cancellation too: the lease's unwritten reservations
                # are aborted. Expired meanwhile: expiry already aborted them.
                close_fetch_lease(node, tenant, lease_id)

    def _stub(self, address: str) -> KVStoreAsyncStub:
        channel = self._channels.get(address)
        if channel is None:
            limit = self.node.config.max_message_bytes
            options = [
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ]
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(address, options=options)
            else:
                channel = grpc.aio.secure_channel(address, self._credentials, options=options)
            self._channels[address] = channel
        return kvstore_pb2_grpc.KVStoreStub(channel)

    async def close(self) -> None:
        """Close every peer channel."""
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()
