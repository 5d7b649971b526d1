"""The cluster-wide event stream on Redis: encoding, appending, reading.

One Redis stream (``{P}:events``, bounded by ``MAXLEN ~``) carries every
node's block events (stored / removed / cleared), of its pool and of its disk
tier, and the registry's node joined / left. Entries are flat fields,
readable from any language:

    kind    stored | removed | cleared | node_joined | node_left
    node    node id
    at      unix seconds (text)
    ns      namespace id        (block events)
    tenant  scope               (block events; "" in shared namespaces)
    parent  32-byte hash        (stored, when the chain has a parent)
    hashes  concatenated 32-byte hashes, in chain order
    tier    "disk" (stored / removed on the node's disk tier); absent on the
            pool's events, as older nodes write them: no tier means memory

`watch` follows the stream from "now" for ``WatchEvents(cluster=true)``,
reconnecting with backoff when Redis goes away (events appended meanwhile
are read once it is back, as long as the stream still holds them).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from redis.backoff import AbstractBackoff

from kvstore.api.wire import EVENT_TIER_MEMORY, event_tier
from kvstore.events import CacheEvent, EventKind
from kvstore.v1 import kvstore_pb2 as pb
from service.cluster.keys import HASH_BYTES
from service.cluster.redis_link import REDIS_ERRORS, backoff_seconds, reconnect_backoff

log = logging.getLogger(__name__)

_KINDS = {
    "stored": pb.EVENT_KIND_STORED,
    "removed": pb.EVENT_KIND_REMOVED,
    "cleared": pb.EVENT_KIND_CLEARED,
    "node_joined": pb.EVENT_KIND_NODE_JOINED,
    "node_left": pb.EVENT_KIND_NODE_LEFT,
}

READ_BLOCK_MS = 500
"""Longest a blocking ``XREAD`` waits (a stopping watcher notices within it)."""


def fields_of(
    ev: CacheEvent, node_id: str, at_unix: float, tier: str = EVENT_TIER_MEMORY
) -> dict[str, bytes]:
    """The stream fields of one cache event of the pool's blocks, or of ``tier``'s.

    The pool's entries carry no ``tier`` field: they stay exactly what every
    node version writes, and a reader of the stream needs one rule (no tier:
    memory) whichever node wrote an entry.
    """
    fields = {
        "kind": ev.kind.value.encode(),
        "node": node_id.encode(),
        "at": f"{at_unix:.6f}".encode(),
        "ns": ev.namespace.encode(),
        "tenant": ev.scope.encode(),
        "hashes": b"".join(ev.hashes),
    }
    if ev.kind is EventKind.STORED and ev.parent is not None:
        fields["parent"] = bytes(ev.parent)
    if tier != EVENT_TIER_MEMORY:
        fields["tier"] = tier.encode()
    return fields


def event_of(fields: dict[bytes, bytes]) -> pb.Event | None:
    """The wire event of a stream entry (None for a kind this version does not know);
    its tier is "memory" on a block entry without one."""
    kind = _KINDS.get(fields.get(b"kind", b"").decode(errors="replace"))
    if kind is None:
        return None
    raw = fields.get(b"hashes", b"")
    event = pb.Event(
        kind=kind,
        namespace_id=fields.get(b"ns", b"").decode(),
        hashes=[raw[i : i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)],
        parent=fields.get(b"parent", b""),
        at=float(fields.get(b"at", b"0") or 0),
        node_id=fields.get(b"node", b"").decode(),
        tenant=fields.get(b"tenant", b"").decode(),
        tier=fields.get(b"tier", b"").decode(errors="replace"),
    )
    event.tier = event_tier(event)  # an entry without one is the pool's
    return event


def append(pipe: Any, stream: str, fields: dict[str, bytes], maxlen: int) -> None:
    """Queue one ``XADD`` (approximate trimming: O(1) amortised)."""
    pipe.xadd(stream, fields, maxlen=maxlen, approximate=True)


async def last_id(client: Any, stream: str) -> bytes:
    """The id of the stream's newest entry (``0-0`` when empty): a watch starts after it."""
    newest = await client.xrevrange(stream, count=1)
    return bytes(newest[0][0]) if newest else b"0-0"


async def watch(
    client: Any,
    stream: str,
    namespace: str,
    start: bytes,
    *,
    stopping: Callable[[], bool],
    block_ms: int = READ_BLOCK_MS,
    backoff: AbstractBackoff | None = None,
) -> AsyncIterator[pb.Event]:
    """Events appended after ``start`` (of ``namespace``, or all when ""), until ``stopping()``.

    Node events have no namespace and are delivered to every watcher.
    """
    backoff = backoff or reconnect_backoff()
    cursor = start
    # Hand-written, not redis-py's Retry: it retries forever yet must see stopping() between tries.
    failures = 0
    while not stopping():
        try:
            reply = await client.xread({stream: cursor}, block=block_ms, count=512)
        except REDIS_ERRORS as exc:
            failures += 1
            log.debug("cluster watch: Redis unavailable (%s); retrying", exc)
            await asyncio.sleep(backoff_seconds(backoff, failures))
            continue
        failures = 0
        for _, entries in reply or ():
            for entry_id, fields in entries:
                cursor = bytes(entry_id)
                event = event_of(fields)
                if event is None:
                    continue
                if namespace and event.namespace_id and event.namespace_id != namespace:
                    continue
                yield event
