"""The client's lease: opened on first need, renewed in the background.

Every pin and every reserved slot belongs to a lease; when the runner dies
the lease expires and the node drops them. `LeaseKeeper` renews the lease
every third of the TTL the node granted (its default unless the client asked
for one), so two renewals may fail before it lapses. When
the node answers that the lease is gone (``NOT_FOUND``: the node restarted;
``FAILED_PRECONDITION``: it expired, e.g. the process was suspended), the
keeper opens a new one and bumps `generation`: pins and reservations made
under an older generation are gone, and the client sends nothing for them.

I/O goes through three callables, so the keeper is tested without a server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from kvstore.client.errors import ServerError, ServerUnavailable
from kvstore.client.retry import Backoff
from kvstore.errors import FailedPrecondition, KVStoreError, NotFound
from kvstore.types import LeaseId

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """A lease as the node granted it."""

    lease_id: LeaseId
    """The lease's id."""
    ttl: float
    """Seconds it lives without renewal."""


OpenLease = Callable[[], Awaitable[LeaseGrant]]
"""Opens a new lease."""
RenewLease = Callable[[LeaseId], Awaitable[float]]
"""Renews a lease; returns the seconds it now has left."""
CloseLease = Callable[[LeaseId], Awaitable[None]]
"""Ends a lease, dropping its pins and writes."""


class LeaseKeeper:
    """Holds one lease at a time for the client and keeps it alive."""

    def __init__(
        self,
        open_lease: OpenLease,
        renew_lease: RenewLease,
        close_lease: CloseLease,
        *,
        backoff: Backoff | None = None,
    ) -> None:
        self._open = open_lease
        self._renew = renew_lease
        self._close = close_lease
        self._backoff = backoff or Backoff(base=0.2, cap=5.0)
        self._grant: LeaseGrant | None = None
        self._opening: asyncio.Task[LeaseGrant] | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._closed = False
        self.generation = 0
        """Bumped whenever a lost lease is replaced; pins of older generations are gone."""
        self.lost = 0
        """How many leases were lost (expired or forgotten by the node)."""

    @property
    def lease_id(self) -> LeaseId | None:
        """The current lease, or None before the first call that needs one."""
        return self._grant.lease_id if self._grant is not None else None

    @property
    def ttl(self) -> float | None:
        """Seconds the node granted the current lease, or None before one is open."""
        return self._grant.ttl if self._grant is not None else None

    async def current(self) -> tuple[LeaseId, int]:
        """The current lease and its generation, opening one if needed.

        Concurrent callers share one OpenLease call; a caller cancelled while
        waiting does not cancel the open for the others.
        """
        if self._closed:
            raise FailedPrecondition("the client is closed")
        if self._grant is None:
            if self._opening is None:
                self._opening = asyncio.ensure_future(self._open_now())
            task = self._opening
            try:
                await asyncio.shield(task)
            finally:
                if task.done() and self._opening is task:
                    self._opening = None
        assert self._grant is not None, "bug: lease open finished without a grant"
        return self._grant.lease_id, self.generation

    async def _open_now(self) -> LeaseGrant:
        grant = await self._open()
        if not grant.ttl > 0:
            raise FailedPrecondition(f"the node granted lease {grant.lease_id:x} no TTL")
        self._grant = grant
        if self._keepalive is None or self._keepalive.done():
            self._keepalive = asyncio.ensure_future(self._keep_alive())
        return grant

    def mark_lost(self, lease_id: LeaseId) -> None:
        """Forget ``lease_id`` (the node no longer knows it); the next call opens a new one."""
        if self._grant is not None and self._grant.lease_id == lease_id:
            log.warning("lease %x is gone; its pins and writes were dropped", lease_id)
            self._grant = None
            self.generation += 1
            self.lost += 1

    async def renew_now(self) -> bool:
        """Renew the lease once; returns False when it was lost (and forgotten)."""
        grant = self._grant
        if grant is None:
            return False
        try:
            await self._renew(grant.lease_id)
        except (NotFound, FailedPrecondition):
            self.mark_lost(grant.lease_id)
            return False
        return True

    async def _keep_alive(self) -> None:
        failures = 0
        while not self._closed:
            grant = self._grant
            if grant is None:
                return  # reopened lazily by the next call that needs a lease
            delay = (
                grant.ttl / 3
                if failures == 0
                else min(self._backoff.compute(failures), grant.ttl / 3)
            )
            await asyncio.sleep(delay)
            try:
                alive = await self.renew_now()
            except ServerUnavailable:
                failures += 1
                continue
            except KVStoreError as exc:
                if _node_going_away(exc):
                    log.debug("renewing lease %x: the node is stopping (%s)", grant.lease_id, exc)
                else:
                    log.exception("renewing lease %x failed", grant.lease_id)
                failures += 1
                continue
            failures = 0
            if not alive:
                with contextlib.suppress(KVStoreError):
                    await self.current()  # replace it now, not on the next call

    async def close(self, *, end_lease: bool = True) -> None:
        """Stop renewing and end the lease on the node (best effort); idempotent.

        With ``end_lease`` False the lease is left to expire by itself.
        """
        if self._closed:
            return
        self._closed = True
        for task in (self._keepalive, self._opening):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, KVStoreError):
                    await task
        grant, self._grant = self._grant, None
        if grant is not None and end_lease:
            try:
                await self._close(grant.lease_id)
            except KVStoreError:
                log.info(
                    "could not close lease %x; it expires in %.0f s", grant.lease_id, grant.ttl
                )


def _node_going_away(exc: KVStoreError) -> bool:
    """A renewal the node cancelled as it stopped (CANCELLED): like an unreachable node,
    retried with back-off, not a bug worth a traceback."""
    return isinstance(exc, ServerError) and exc.code == grpc.StatusCode.CANCELLED
