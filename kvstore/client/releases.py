"""A client's releases: sent in the background, each exactly once, folded when they queue.

A runner that serves many requests at once releases many hits at once, and
each ``Release`` is a round trip that costs the node about a Ping's worth of
work. So, per (namespace, lease), a lane: a release with no call of its
lane in flight (no Release, no pinned Lookup) is sent at once, alone (a
lone caller waits for nothing more than before); releases that come while
calls are in flight queue, and go out with the next pinned Lookup of the
lane (below), or, when the lane's calls in flight have ended without one,
together as one ``Release`` (a runner whose tasks each wait for their
release before the next lookup sends one Release for a whole wave), each hit's hashes one run of
``ReleaseRequest.runs`` (at most `MAX_RUNS` hits and `MAX_HASHES` hashes a
call), which the node releases exactly as that many separate calls would.
A queued release waits at most for the calls in flight of its lane. Each caller still
waits for the node's answer for its own hit and gets its own count
(``run_released``); a failed call fails every caller in it.

This module is the SDK's one route for a release: `Client.release`, a
release whose caller was cancelled, and a pinned Lookup cancelled in flight
(released here once the node answers it) all go through `Releases.submit`.

Pins are dropped exactly once per hit, whatever happens to the caller:

* Every call is a background task (`Background`), so a caller that is
  cancelled or stops waiting (its timeout) hands its release over: sent
  alone or queued, it still goes out and runs to its end.
* A pinned Lookup of the same lane takes the releases queued there with it
  (``LookupRequest.release``, `carry`): the node applies them before the
  lookup, in the same call, so a busy runner's Lookup+Release pair is one
  call, not two. If that Lookup fails, is cancelled or is answered by a
  node that ignores the field, its releases go out again as a ``Release``
  (`settle_carried`), under the same ids.
* Every hit's release carries its own id (``release_ids``, one per run):
  the id its pinned Lookup declared (``LookupRequest.release_id``, chosen by
  `Client.lookup` with `new_release_id`). The node drops exactly the pins
  that Lookup took, once, and a spent id drops nothing, so a call whose
  outcome is unknown (a timeout, a lost connection) is retried by the
  `RetryPolicy` like any idempotent call, and a caller may release the same
  hit again, however late: neither drops the pin that another hit of the
  same lease holds on the same block.
* A release the node did not answer (unavailable, or no answer in time:
  a node that hung or a host that stalled) fails its callers, and is sent
  again in the background (`RESEND_BACKOFF`, same ids) until the node
  answers it or says the lease is gone: the lease is renewed for the
  runner's life, so a release given up would pin its blocks until then.
  Closing the client stops the re-sends (its lease's end drops the pins).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from dataclasses import dataclass, field

from kvstore.client import methods
from kvstore.client.background import Background
from kvstore.client.errors import DeadlineExceeded, ServerUnavailable
from kvstore.client.retry import Backoff
from kvstore.client.rpc import Rpc
from kvstore.errors import KVStoreError
from kvstore.types import HASH_BYTES
from kvstore.v1 import kvstore_pb2 as pb

MAX_RUNS = 64
"""Most hits one folded ``Release`` carries (the node takes up to `wire.MAX_RELEASE_RUNS`)."""

MAX_HASHES = 16_384
"""Most hashes one folded ``Release`` carries (512 KiB of request; the node's
``max_request_bytes`` default is 2 MiB)."""

log = logging.getLogger(__name__)

_Key = tuple[str, int]

RESEND_BACKOFF = Backoff(base=1.0, cap=30.0)
"""Delay before each re-send of a release the node did not answer: about 1 s, doubling to 30 s."""


@dataclass(eq=False)  # a waiter is itself, whatever hashes it releases
class _Waiting:
    packed: bytes
    release_id: int
    done: asyncio.Future[int]
    corrupt: bytes = b""
    """Hashes of this hit's blocks whose bytes failed their checksum (``packed_corrupt``)."""
    resent: bool = False
    """A re-send (`Releases._resend`): its failure is that loop's to handle."""


def new_release_id() -> int:
    """A random nonzero 64-bit id that names one pinned lookup's pins (and its release)."""
    return secrets.randbits(64) or 1


@dataclass(eq=False)
class _Lane:
    """One (namespace, lease)'s calls in flight and the releases queued behind them."""

    queued: list[_Waiting] = field(default_factory=list)
    sending: bool = False
    """A ``Release`` of this lane is in flight."""
    lookups: int = 0
    """Pinned Lookups of this lane in flight (each may carry the queue when sent)."""

    @property
    def idle(self) -> bool:
        return not (self.sending or self.lookups or self.queued)


class Releases:
    """Sends a client's releases in the background, folding those that queue behind one."""

    def __init__(self, rpc: Rpc, background: Background) -> None:
        self._rpc = rpc
        self._background = background
        # Per (namespace, lease) with a call in flight: the releases queued behind it.
        self._lanes: dict[_Key, _Lane] = {}
        self._resends: set[asyncio.Task[None]] = set()
        self.calls = 0
        """``Release`` calls sent (for tests and tools)."""
        self.carried = 0
        """Hits' releases sent inside a Lookup, less those sent again after it (for tests)."""

    def submit(
        self, namespace_id: str, lease_id: int, packed: bytes, release_id: int, corrupt: bytes = b""
    ) -> asyncio.Future[int]:
        """Hand one hit's release (its hashes, packed; its id) over; the pins it dropped.

        Sent at once when no call of its lane is in flight (no Release, no
        pinned Lookup), else queued. The release goes out whatever happens
        to the returned future (cancelling it only stops the waiting); the
        future's result is the node's count. ``corrupt``: the hashes of this
        hit's blocks whose bytes failed their checksum, which the node checks
        and drops (``ReleaseRequest.packed_corrupt``).
        """
        return self._enqueue((namespace_id, lease_id), packed, release_id, corrupt, resent=False)

    def _enqueue(
        self, key: _Key, packed: bytes, release_id: int, corrupt: bytes, *, resent: bool
    ) -> asyncio.Future[int]:
        loop = asyncio.get_running_loop()
        waiting = _Waiting(packed, release_id, loop.create_future(), corrupt, resent)
        waiting.done.add_done_callback(_retrieve)  # a caller may have stopped waiting
        lane = self._lanes.get(key)
        if lane is None:
            self._lanes[key] = lane = _Lane()
        lane.queued.append(waiting)
        if not (lane.sending or lane.lookups):
            self._flush(key, lane)
        return waiting.done

    async def release(
        self,
        namespace_id: str,
        lease_id: int,
        packed: bytes,
        release_id: int,
        timeout: float | None,
        corrupt: bytes = b"",
    ) -> int:
        """Release one hit's pins and wait (at most ``timeout``) for the node's count.

        Raises:
            DeadlineExceeded: no answer in time; the release is still on its
                way (a repeat with the same id is safe).
        """
        done = self.submit(namespace_id, lease_id, packed, release_id, corrupt)
        try:
            return await asyncio.wait_for(asyncio.shield(done), timeout or self._rpc.timeout)
        except TimeoutError:
            raise DeadlineExceeded("Release: no answer within the timeout") from None

    def carry(self, req: pb.LookupRequest) -> list[_Waiting]:
        """A pinned Lookup is sent: count it in flight, and move its lane's queue into it.

        The releases queued in the lookup's (namespace, lease) lane go in
        ``req.release``: the node applies them before the lookup, in the same
        call. The caller must hand the result to `settle_carried` when the
        call ends, whatever the outcome (it also counts the lookup out). A
        lookup with ``allow_remote`` (a peer fetch may take seconds) carries
        the queue but does not hold the lane: releases behind it go alone.
        """
        key = (req.namespace_id, req.lease_id)
        lane = self._lanes.get(key)
        if lane is None:
            self._lanes[key] = lane = _Lane()
        if not req.allow_remote:
            lane.lookups += 1
        if not lane.queued:
            return []
        batch = _take(lane.queued)
        req.release.packed_hashes = b"".join(w.packed for w in batch)
        req.release.release_ids.extend(w.release_id for w in batch)
        req.release.packed_corrupt = b"".join(w.corrupt for w in batch)
        if len(batch) > 1:
            req.release.runs.extend(len(w.packed) // HASH_BYTES for w in batch)
        self.carried += len(batch)
        return batch

    def settle_carried(
        self, req: pb.LookupRequest, batch: list[_Waiting], call: asyncio.Future[pb.LookupResponse]
    ) -> None:
        """A pinned Lookup ended: answer its releases, or send them again as a Release.

        Sent again (same ids: the node applies each once) when the call failed,
        was cancelled, or came back without ``released`` (a node that predates
        the field ignored it). With no call of the lane left in flight, what
        queued meanwhile goes out as one Release.
        """
        key = (req.namespace_id, req.lease_id)
        lane = self._lanes.get(key)
        if lane is None:
            # Only an ``allow_remote`` Lookup (it does not hold its lane): the lane went
            # idle and was dropped while it was in flight. Its releases still settle.
            assert req.allow_remote, "bug: a lane dropped under a pinned Lookup in flight"
            self._lanes[key] = lane = _Lane()
        if not req.allow_remote:
            lane.lookups -= 1
        resp = None if call.cancelled() or call.exception() else call.result()
        if batch and (resp is None or not resp.HasField("released")):
            self.carried -= len(batch)
            lane.queued[:0] = batch  # first in line
        elif batch and resp is not None:
            released = resp.released
            counts = list(released.run_released) if len(batch) > 1 else [int(released.released)]
            if len(counts) != len(batch):  # not this SDK's node: each hit's own hash count
                counts = [len(w.packed) // HASH_BYTES for w in batch]
            for w, count in zip(batch, counts, strict=True):
                if not w.done.done():
                    w.done.set_result(count)
        self._next(key, lane)

    def _next(self, key: _Key, lane: _Lane) -> None:
        """A call of the lane ended: send what queued if nothing else is in flight."""
        if lane.idle:
            del self._lanes[key]
        elif lane.queued and not (lane.sending or lane.lookups):
            self._flush(key, lane)

    def _flush(self, key: _Key, lane: _Lane) -> None:
        """Send the first queued releases as one Release call."""
        lane.sending = True
        self._background.spawn(self._send(key, lane, _take(lane.queued)))

    async def _send(self, key: _Key, lane: _Lane, batch: list[_Waiting]) -> None:
        try:
            req = pb.ReleaseRequest(
                namespace_id=key[0],
                lease_id=key[1],
                packed_hashes=b"".join(w.packed for w in batch),
                release_ids=[w.release_id for w in batch],
                packed_corrupt=b"".join(w.corrupt for w in batch),
            )
            if len(batch) > 1:
                req.runs.extend(len(w.packed) // HASH_BYTES for w in batch)
            self.calls += 1
            # Idempotent through its ids: a retry drops nothing a first attempt did.
            resp = await self._rpc.call(methods.RELEASE, req, None, idempotent=True)
            counts = list(resp.run_released) if req.runs else [int(resp.released)]
            if len(counts) != len(batch):
                # A node that predates ``runs`` released the hashes as one run:
                # the same pins; each hit gets its own number of hashes.
                counts = list(req.runs)
            for w, count in zip(batch, counts, strict=True):
                if not w.done.done():
                    w.done.set_result(count)
        except BaseException as exc:
            again = [w for w in batch if not w.resent]
            if isinstance(exc, ServerUnavailable) and again:
                log.warning("release of %d hits failed, sending it again: %s", len(again), exc)
                self._spawn_resend(key, again)
            elif isinstance(exc, KVStoreError) and again:  # their callers get it too
                log.warning("release of %d hits failed (their lease drops them when it ends): %s",
                            len(again), exc)  # fmt: skip
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
            lane.sending = False
            self._next(key, lane)

    def _spawn_resend(self, key: _Key, batch: list[_Waiting]) -> None:
        releases = [(w.packed, w.release_id, w.corrupt) for w in batch]
        task = asyncio.ensure_future(self._resend(key, releases))
        self._resends.add(task)
        task.add_done_callback(self._resends.discard)

    async def _resend(self, key: _Key, releases: list[tuple[bytes, int, bytes]]) -> None:
        """Send releases again, after `RESEND_BACKOFF`, until the node answers each of them
        (the same ids: a release it had applied drops nothing more) or refuses it."""
        for failures in itertools.count(1):
            await asyncio.sleep(RESEND_BACKOFF.compute(failures))
            sent = [self._enqueue(key, *release, resent=True) for release in releases]
            outcomes = await asyncio.gather(*sent, return_exceptions=True)
            unanswered = []
            for release, outcome in zip(releases, outcomes, strict=True):
                if isinstance(outcome, ServerUnavailable):
                    unanswered.append(release)
                elif isinstance(outcome, BaseException):  # refused: the lease is gone
                    log.warning("release sent again refused (its lease dropped it): %s", outcome)
            if not unanswered:
                return
            releases = unanswered

    def close(self) -> None:
        """Stop sending releases again (the client is closing: its lease's end drops them)."""
        for task in list(self._resends):
            task.cancel()


def _take(lane: list[_Waiting]) -> list[_Waiting]:
    """The first waiters of a queue that one call carries (`MAX_RUNS`, `MAX_HASHES`)."""
    batch: list[_Waiting] = []
    hashes = 0
    while lane and len(batch) < MAX_RUNS:
        n = len(lane[0].packed) // HASH_BYTES
        if batch and hashes + n > MAX_HASHES:
            break
        batch.append(lane.pop(0))
        hashes += n
    return batch


def _retrieve(done: asyncio.Future[int]) -> None:
    """Mark a release's outcome as seen: its caller may be gone (the failure is logged)."""
    if not done.cancelled():
        done.exception()
