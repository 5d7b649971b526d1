"""Moving block bytes: the store protocol (Reserve → copy → Commit) and gRPC reads.

`store_chain` writes through the pool mapping when the client has one and
streams the blocks with ``WriteBlocks`` otherwise. Whatever happens after
the Reserve (a block callable raising, a wrong-sized block, a cancellation,
a failed Commit), every slot this call reserved is aborted before the error
propagates, so no slot stays WRITING until the lease expires.

Copies through the mapping are fenced by the lease (``docs/leases.md``,
"Late writers"): before each copy the session checks, on this process's
clock, that the node surely still holds the lease that reserved the slots;
if not (the process stalled past the lease's expiry), the store fails with
`LeaseExpired` and those blocks and every later one are never written.

Into a host pool, blocks given as one array (``(n_blocks, ...)``,
C-contiguous) are copied one run of adjacent slots at a time (`slot_runs`,
the lease checked every `RUN_BYTES`), block by block into the arena views;
other blocks are copied one by one into the same views.

The checksum a host pool's Commit sends is the writer's hash of its *source*
bytes, taken right after each block's copy while they are in cache
(`copy_block_hashed`): never a re-read of the slot, where a late writer's
copy landing between this copy and the hash would be committed with a
checksum of the wrong bytes (issue 40, item 2). One pass over the source,
about 1.2x numpy's copy for the copy and the hash together (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from array import array
from collections.abc import AsyncIterator, Callable

from kvstore.checksum import block_checksum, pack_checksums
from kvstore.client import methods
from kvstore.client.background import quietly
from kvstore.client.blocks import (
    BlockSupplier,
    block_at,
    block_bytes_of,
    chain_array,
    copy_block_hashed,
    copy_block_to_tensor,
    slot_runs,
)
from kvstore.client.errors import PoolEpochChanged
from kvstore.client.handles import Namespace, StoreResult
from kvstore.client.hit import Hit
from kvstore.client.replies import ChainFields, Reservation, reservation_from_proto
from kvstore.client.session import NodeSession
from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound
from kvstore.pool import PoolDescriptor
from kvstore.pool.host import HostMapping
from kvstore.types import SlotId
from kvstore.v1 import kvstore_pb2 as pb

_RESERVED = pb.RESERVE_STATUS_RESERVED

RUN_BYTES = 16 << 20
"""Most bytes one copy of a run moves between lease checks (~3 ms at 6 GB/s): well
inside the lease's safety margin, whatever the arena size."""


async def store_chain(
    session: NodeSession,
    ns: Namespace,
    fields: Callable[[], ChainFields],
    blocks: BlockSupplier,
    timeout: float | None,
) -> StoreResult:
    """Reserve the missing blocks of a chain, write them and commit them (see `Client.store`).

    ``fields`` gives the Reserve's chain fields once the namespace is ready
    (again after a node restart: a prompt is hashed under the root of now).
    """
    for attempt in (0, 1):
        await session.ensure_ready(ns, timeout)
        lease_id, _ = await session.lease.current()
        try:
            resp = await _reserve(session, ns, lease_id, fields(), timeout)
        except (NotFound, FailedPrecondition):
            # After a node restart the lease (or namespace) is unknown: recover once.
            if attempt == 0 and await session.recover(True):
                continue
            raise
        break
    committed = 0
    packed = b""
    try:
        res = reservation_from_proto(resp)
        packed = res.packed_reserved()
        if session.observe_epoch(res.epoch) or (session.map_pool and res.epoch != ns.epoch):
            raise PoolEpochChanged("the node restarted during a store; store again")
        if packed:
            if session.map_pool:
                await session.refresh_arenas(ns, res.version, timeout)
                await session.refresh_lease(lease_id)
                sums = _copy_in(ns, res, blocks, lambda: session.lease_alive(lease_id))
                req_c = pb.CommitRequest(
                    namespace_id=ns.id,
                    lease_id=lease_id,
                    packed_hashes=packed,
                    packed_checksums=pack_checksums(sums) if sums else b"",
                )
                committed = (
                    await session.rpc.call(methods.COMMIT, req_c, timeout, idempotent=False)
                ).committed
            else:
                committed = await _stream_in(session, ns, lease_id, res, blocks, timeout)
    except BaseException:
        if packed:  # empty: nothing reserved, or a reply that could not be read
            abort = pb.AbortRequest(namespace_id=ns.id, lease_id=lease_id, packed_hashes=packed)
            await session.background.cleanup(
                quietly("abort", session.rpc.call(methods.ABORT, abort, None, idempotent=False))
            )
        raise
    counts = [0, 0, 0, 0]
    for status in res.statuses:
        counts[status] += 1
    return StoreResult(
        reserved=counts[_RESERVED],
        hit=counts[pb.RESERVE_STATUS_HIT],
        in_flight=counts[pb.RESERVE_STATUS_IN_FLIGHT],
        no_room=counts[pb.RESERVE_STATUS_NO_ROOM],
        committed=committed,
        chain=tuple(res.hashes),
    )


def _reserved_hashes(resp: pb.ReserveResponse) -> bytes:
    """The RESERVED entries' hashes of a Reserve reply, packed; b"" if it cannot be read."""
    try:
        res = reservation_from_proto(resp)
    except InvalidArgument:
        return b""
    return res.packed_reserved()


async def _reserve(
    session: NodeSession,
    ns: Namespace,
    lease_id: int,
    fields: ChainFields,
    timeout: float | None,
) -> pb.ReserveResponse:
    req = pb.ReserveRequest(namespace_id=ns.id, lease_id=lease_id, **fields)
    call = asyncio.ensure_future(session.rpc.call(methods.RESERVE, req, timeout, idempotent=False))
    try:
        resp: pb.ReserveResponse = await asyncio.shield(call)
    except asyncio.CancelledError:
        # The node may reserve before we stop listening: abort what it reserved.
        session.background.spawn(_abort_when_done(session, ns.id, lease_id, call))
        raise
    return resp


def _copy_in(
    ns: Namespace,
    res: Reservation,
    blocks: BlockSupplier,
    lease_alive: Callable[[], None],
) -> array[int] | None:
    """Copy the reserved blocks into their slots; the checksums of their source bytes
    (None: a CUDA pool, whose writers send none: no device kernel for it yet, docs/cuda.md)."""
    mapping = ns.mapping
    if mapping is None or mapping.closed:
        raise PoolEpochChanged("the pool mapping was dropped during a store; store again")
    _check_placement(mapping.descriptor, res)
    indexes = res.reserved
    slots = [res.slots[i] for i in indexes]
    sums: array[int] | None = None
    try:
        if isinstance(mapping, HostMapping):
            sums = _copy_runs(mapping, indexes, slots, blocks, lease_alive)
        else:
            cuda = mapping.descriptor.kind == "cuda"
            for index, slot in zip(indexes, slots, strict=True):
                block = block_at(blocks, index)  # may take long: a GPU gather, a slow callable
                lease_alive()  # raises LeaseExpired: then this slot may be someone else's
                if cuda:
                    copy_block_to_tensor(block, mapping.torch_view(slot, ns.layout))
                else:
                    copy_block_hashed(block, mapping.buffer(slot))
    except BaseException:
        # CUDA copies already queued finish before the caller's Abort frees their slots.
        with contextlib.suppress(Exception):
            mapping.synchronize()
        raise
    # CUDA pools: the copies must be complete before Commit makes the blocks
    # visible to other processes (docs/cuda.md); host pools return at once.
    mapping.synchronize()
    return sums


def _check_placement(descriptor: PoolDescriptor, res: Reservation) -> None:
    """Refuse to copy when the node places slots where the mapping does not.

    Raises:
        FailedPrecondition: the pool changed between the mapping and the Reserve.
    """
    # Where a slot lies follows from two numbers: the reply's and the mapping's agree.
    if (res.slots_per_arena, res.block_bytes) != (
        descriptor.slots_per_arena,
        descriptor.block_bytes,
    ):
        raise FailedPrecondition(
            f"the node's pool has {res.slots_per_arena} slots of {res.block_bytes} bytes "
            f"an arena, the mapping {descriptor.slots_per_arena} of "
            f"{descriptor.block_bytes}: the pool changed; store again"
        )


def _copy_runs(
    mapping: HostMapping,
    indexes: list[int],
    slots: list[SlotId],
    blocks: BlockSupplier,
    lease_alive: Callable[[], None],
) -> array[int]:
    """Host pools: copy block by block into each run's arena view, hashing each source
    block right after its copy (`copy_block_hashed`); the checksums, in ``slots`` order.

    One ``memcpy`` per run was no faster than one per block plus the hash of
    the block while it is in cache, and a run's source is too big to stay
    there for a hash after it (16 MiB against a 1-2 MiB L2).
    """
    spa, block_bytes = mapping.descriptor.slots_per_arena, mapping.descriptor.block_bytes
    rows = chain_array(blocks, block_bytes)
    if rows is not None and indexes and max(indexes) >= len(rows):
        rows = None  # too few blocks: the per-block path says which one is missing
    chunk = max(1, RUN_BYTES // block_bytes)
    sums = array("Q", bytes(8 * len(slots)))
    digest = block_checksum
    for a, b in itertools.pairwise(slot_runs(slots, indexes, spa)):
        arena = mapping.arena_buffer(slots[a] // spa)
        offset = slots[a] % spa * block_bytes
        if rows is not None:
            for c in range(a, b, chunk):
                lease_alive()  # raises LeaseExpired: then these slots may be someone else's
                for k in range(c, min(c + chunk, b)):
                    source = rows[indexes[k]].data
                    start = offset + (k - a) * block_bytes
                    arena[start : start + block_bytes] = source
                    sums[k] = digest(source)  # the source, still in cache
            continue
        for k in range(a, b):
            block = block_at(blocks, indexes[k])  # may take long: a slow callable
            lease_alive()
            start = offset + (k - a) * block_bytes
            sums[k] = copy_block_hashed(block, arena[start : start + block_bytes])
    return sums


async def _stream_in(
    session: NodeSession,
    ns: Namespace,
    lease_id: int,
    res: Reservation,
    blocks: BlockSupplier,
    timeout: float | None,
) -> int:
    # Materialise first: a failing block callable must fail before anything is sent.
    payloads = [(res.hashes[i], block_bytes_of(block_at(blocks, i))) for i in res.reserved]
    for _, data in payloads:
        if len(data) != ns.block_bytes:
            raise InvalidArgument(f"a block is {ns.block_bytes} bytes, got {len(data)}")

    async def requests() -> AsyncIterator[pb.WriteBlocksRequest]:
        header = pb.WriteBlocksHeader(namespace_id=ns.id, lease_id=lease_id, commit=True)
        yield pb.WriteBlocksRequest(header=header)
        for digest, data in payloads:
            block = pb.BlockData(hash=digest, data=data, checksum=block_checksum(data))
            yield pb.WriteBlocksRequest(block=block)

    resp = await session.rpc.send(methods.WRITE_BLOCKS, requests(), timeout)
    return int(resp.committed)


async def _abort_when_done(
    session: NodeSession, namespace: str, lease_id: int, call: asyncio.Future[pb.ReserveResponse]
) -> None:
    try:
        resp = await call
    except Exception:
        return
    packed = _reserved_hashes(resp)
    if packed:
        req = pb.AbortRequest(namespace_id=namespace, lease_id=lease_id, packed_hashes=packed)
        await quietly("abort", session.rpc.call(methods.ABORT, req, None, idempotent=False))


async def read_hit(
    session: NodeSession,
    hit: Hit,
    timeout: float | None,
) -> list[bytes]:
    """The bytes of a pinned hit's blocks, streamed with ``ReadBlocks``."""
    if not hit.pinned or hit.released:
        raise FailedPrecondition("read_blocks needs a pinned, unreleased hit")
    lease_id = session.lease.lease_id or 0
    refs = [pb.BlockRef(hash=b.hash, slot=b.slot, generation=b.generation) for b in hit.blocks]
    req = pb.ReadBlocksRequest(namespace_id=hit.namespace.id, lease_id=lease_id, blocks=refs)
    by_hash: dict[bytes, bytes] = {}
    async for item in session.rpc.stream(methods.READ_BLOCKS, req, timeout):
        by_hash[item.hash] = item.data
    return [by_hash[b.hash] for b in hit.blocks]
