"""Releases that wait behind one in flight are folded into one ``Release`` call.

A runner that serves many requests at once releases many hits at once, and
each ``Release`` is a round trip that costs the node about a Ping's worth of
work. So, per (namespace, lease): a release with none in flight is sent at
once, alone (a lone caller waits for nothing more than before); releases
that come while one is in flight queue, and when it returns they go out
together as one call, each hit's hashes one run of ``ReleaseRequest.runs``
(at most `MAX_RUNS` hits and `MAX_HASHES` hashes a call), which the node
releases exactly as that many separate calls would. Each caller still
waits for the node's answer for its own hit and gets its own count
(``run_released``); a failed call fails every caller in it.

A caller cancelled while its hit still waits in the queue takes it out
(nothing was sent); once sent, the call runs to its end for the others.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvstore.client.background import Background
from kvstore.client.errors import DeadlineExceeded
from kvstore.client.rpc import Rpc
from kvstore.types import HASH_BYTES
from kvstore.v1 import kvstore_pb2 as pb

MAX_RUNS = 64
"""Most hits one folded ``Release`` carries (the node takes up to `wire.MAX_RELEASE_RUNS`)."""

MAX_HASHES = 16_384
"""Most hashes one folded ``Release`` carries (512 KiB of request; the node's
``max_request_bytes`` default is 2 MiB)."""

_Key = tuple[str, int]


@dataclass(eq=False)  # a waiter is itself, whatever hashes it releases
class _Waiting:
    packed: bytes
    done: asyncio.Future[int]


class Releases:
    """Sends a client's releases, folding those that queue behind one in flight."""

    def __init__(self, rpc: Rpc, background: Background) -> None:
        self._rpc = rpc
        self._background = background
        # Per (namespace, lease) with a call in flight: the releases queued behind it.
        self._lanes: dict[_Key, list[_Waiting]] = {}
        self.calls = 0
        """``Release`` calls sent (for tests and tools)."""

    async def release(
        self, namespace_id: str, lease_id: int, packed: bytes, timeout: float | None
    ) -> int:
        """Release one hit's pins (its hashes, packed); returns the pins the node released."""
        key = (namespace_id, lease_id)
        lane = self._lanes.get(key)
        if lane is None:
            self._lanes[key] = lane = []
            try:
                req = pb.ReleaseRequest(
                    namespace_id=namespace_id, lease_id=lease_id, packed_hashes=packed
                )
                self.calls += 1
                resp = await self._rpc.call("Release", req, timeout, idempotent=False)
                return int(resp.released)
            finally:
                self._next(key, lane)
        waiting = _Waiting(packed, asyncio.get_running_loop().create_future())
        lane.append(waiting)
        try:
            return await asyncio.wait_for(
                asyncio.shield(waiting.done), timeout or self._rpc.timeout
            )
        except (asyncio.CancelledError, TimeoutError) as exc:
            if waiting in lane:  # never sent: nothing to undo
                lane.remove(waiting)
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded("Release: no answer within the timeout") from None
            raise

    def _next(self, key: _Key, lane: list[_Waiting]) -> None:
        """After a call: send what queued meanwhile as one call, or retire the lane."""
        if not lane:
            del self._lanes[key]
            return
        batch: list[_Waiting] = []
        hashes = 0
        while lane and len(batch) < MAX_RUNS:
            n = len(lane[0].packed) // HASH_BYTES
            if batch and hashes + n > MAX_HASHES:
                break
            batch.append(lane.pop(0))
            hashes += n
        self._background.spawn(self._send(key, lane, batch))

    async def _send(self, key: _Key, lane: list[_Waiting], batch: list[_Waiting]) -> None:
        try:
            req = pb.ReleaseRequest(
                namespace_id=key[0],
                lease_id=key[1],
                packed_hashes=b"".join(w.packed for w in batch),
                runs=[len(w.packed) // HASH_BYTES for w in batch],
            )
            self.calls += 1
            resp = await self._rpc.call("Release", req, None, idempotent=False)
            counts = list(resp.run_released)
            if len(counts) != len(batch):
                # A node that predates ``runs`` released the hashes as one run:
                # the same pins; each hit gets its own number of hashes.
                counts = list(req.runs)
            for w, count in zip(batch, counts, strict=True):
                if not w.done.done():
                    w.done.set_result(count)
        except BaseException as exc:
            for w in batch:
                if w.done.done():
                    continue
                if isinstance(exc, Exception):
                    w.done.set_exception(exc)
                else:  # cancelled (the client is closing): so are its callers
                    w.done.cancel()
            if not isinstance(exc, Exception):
                raise
        finally:
            self._next(key, lane)
