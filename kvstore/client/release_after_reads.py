"""`Client.release`: a hit's pins dropped once the GPU has finished reading them.

A released slot may be evicted and rewritten by another runner at once, and
kernels reading a CUDA pool's views run after the call that queued them
returns: so the ``Release`` of a hit goes out only once the reads queued on
the caller's streams are done (`PoolMapping.read_fence`), and, once handed
over, goes out even if the caller is cancelled. Every release takes the one
route of `kvstore.client.releases` under the id that names the hit's pins;
the hit's own state (held, releasing, answered) is `kvstore.client.hit_release`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.client.background import Background, quietly
from kvstore.client.hit import Hit
from kvstore.client.lease_keeper import LeaseKeeper
from kvstore.client.releases import Releases
from kvstore.errors import InvalidArgument
from kvstore.types import HASH_BYTES

__all__ = ["ReleaseAfterReads"]


class ReleaseAfterReads:
    """`Client`'s ``release`` (a mixin: the client module stays one concept long)."""

    _background: Background
    _lease: LeaseKeeper
    _releases: Releases

    async def release(
        self,
        hit: Hit,
        *,
        streams: Sequence[Any] | None = None,
        timeout: float | None = None,
        corrupt: Sequence[int] = (),
    ) -> int:
        """Drop the pins of a hit once the GPU has finished reading it.

        A released slot may be evicted and rewritten by another runner at
        once, and kernels reading a CUDA pool's views run after the call that
        queued them returns. So for a CUDA pool, ``Release`` is sent only
        after the reads queued so far are complete: an event is recorded on
        each stream the caller read on, and waited for (in a worker thread,
        the event loop stays free). Host pools wait for nothing.

        Releases that come while another of the same lease is in flight are
        sent together, as one call, when it returns (`kvstore.client.releases`).

        Args:
            hit: a hit of `lookup`. Once the node answered, a second release
                (or one of an unpinned hit) sends nothing; after a failure or a
                timeout, a second one sends the hit's release again under the
                same id, which the node applies once.
            streams: the ``torch.cuda.Stream`` objects the hit's views were read on,
                or ``torch.cuda.Event`` objects recorded after the reads. None (the
                default): the calling thread's current streams on the pool's
                GPU and the runner's GPU (the whole GPUs when torch has not
                initialised CUDA). ``()``: nothing to wait for.
            timeout: how long to wait for the node's answer; the release goes
                on in the background after it (`DeadlineExceeded`), as it does
                when the caller is cancelled.
            corrupt: indices of the hit's blocks whose bytes failed their
                checksum (`Hit.check_bytes`): reported with the release, the
                node checks their slots itself and drops the blocks that fail
                there too, once unpinned, so later loads miss them instead of
                recomputing after every copy.

        Returns:
            Pins the node released.
        """
        if any(not 0 <= i < hit.hit_blocks for i in corrupt):
            raise InvalidArgument(f"corrupt names blocks outside the hit's {hit.hit_blocks}")
        if not hit.pinned or not hit.hit_blocks:
            hit.release.settle()  # nothing to release; no views either
            return 0
        if hit.release.answered:
            return 0  # the node dropped this hit's pins already
        hit.release.begin()  # no new views from here on, whatever happens next
        if hit.lease_generation != self._lease.generation:
            hit.release.settle()
            return 0  # that lease is gone, and its pins with it
        reads_done = hit.mapping.read_fence(streams) if hit.mapping is not None else None
        if reads_done is not None:
            try:
                await asyncio.to_thread(reads_done)
            except asyncio.CancelledError:
                # Not sent yet: the background waits for the reads, then sends it.
                self._background.spawn(self._release_after(hit, reads_done, corrupt))
                raise
        # Once handed over, the release goes out even if this caller is cancelled;
        # after a failure or a timeout, calling release again is safe (same id).
        return await self._send_release(hit, timeout, corrupt)

    async def _release_after(
        self, hit: Hit, reads_done: Callable[[], None], corrupt: Sequence[int]
    ) -> None:
        """A release whose caller was cancelled while the GPU reads ran: finish it."""
        await asyncio.to_thread(reads_done)
        await quietly("release", self._send_release(hit, None, corrupt))

    async def _send_release(
        self,
        hit: Hit,
        timeout: float | None = None,
        corrupt: Sequence[int] = (),
    ) -> int:
        if hit.lease_id is None:  # the pins' lease, never a replacement's
            return 0
        # Every pinned hit of `lookup` names its pins with an id: the one release
        # route (`Releases`) retries and re-sends under it. A hit built by hand
        # from a Lookup sent without one could only be released by hash, once,
        # with no retry (a retry could drop another hit's pins): refused.
        if not hit.release_id:
            raise InvalidArgument(
                "this pinned hit has no release id (LookupRequest.release_id): "
                "release hits that Client.lookup returned"
            )
        hashes = hit.hit_hashes
        reported = b"".join(hashes[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in corrupt)
        count = await self._releases.release(
            hit.namespace.id, hit.lease_id, hashes, hit.release_id, timeout, reported
        )
        hit.release.settle()
        return count
