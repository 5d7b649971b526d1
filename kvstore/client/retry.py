"""Retries of idempotent calls: one backoff value object, one dozen-line loop.

Only calls that are safe to repeat go through `RetryPolicy.call` (Lookup
without pin, Stats, Ping, RegisterNamespace, AttachPool, KeepAlive), and only
on ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED``. The caller's timeout is a
deadline for all attempts together, not per attempt: a call never takes
longer than the timeout it was given. The channel reconnects by itself;
the backoff only spaces the attempts.

Why not gRPC's own retries (a ``retryPolicy`` in the ``grpc.service_config``
channel option): that policy is per *method*, and ``Lookup`` is idempotent
only without ``pin`` (a retried pinned Lookup could pin twice), so it cannot
say which calls may repeat; it also caps ``maxAttempts`` at 5 and treats
``DEADLINE_EXCEEDED`` as the end of the call, not as retryable. One policy
object for every idempotent call keeps the rule in one place.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

T = TypeVar("T")

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Status codes worth another attempt of an idempotent call."""


@dataclass(slots=True)
class Backoff:
    """Jittered exponential backoff: ``uniform(0.5, 1) * min(cap, base * 2**(failures-1))``.

    Half of the delay is fixed and half random ("equal jitter"): clients that
    failed together spread out, yet none retries almost at once.
    """

    base: float = 0.05
    """Delay before the first retry, before jitter (seconds)."""
    cap: float = 2.0
    """Largest delay, before jitter (seconds)."""
    rng: random.Random = field(default_factory=random.Random, repr=False)
    """Source of the jitter (seed it in tests)."""

    def compute(self, failures: int) -> float:
        """Seconds to wait after ``failures`` consecutive failures (``failures >= 1``)."""
        exponent = min(max(failures, 1) - 1, 62)  # no float overflow on long outages
        ceiling = min(self.cap, self.base * 2.0**exponent)
        return ceiling / 2 + self.rng.uniform(0.0, ceiling / 2)

    def reset(self) -> None:
        """Forget past failures; this backoff is stateless, so there is nothing to forget."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and on what an idempotent call is repeated."""

    attempts: int = 4
    """Tries in total, the first included (1 = no retry)."""
    backoff: Backoff = field(default_factory=Backoff)
    """Delay between tries."""
    retry_on: frozenset[grpc.StatusCode] = RETRYABLE
    """Status codes that get another try."""

    async def call(
        self,
        attempt: Callable[[float | None], Awaitable[T]],
        timeout: float | None,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> T:
        """Run ``attempt(remaining_timeout)`` until it succeeds or may not be retried.

        Args:
            attempt: one try; receives the seconds left of ``timeout``.
            timeout: deadline of all tries together, in seconds (None: none).
            sleep: how to wait between tries (tests pass a fake).
            clock: monotonic clock measuring the deadline.

        Raises:
            grpc.RpcError: the last failure, when it is not retryable, the
                tries are used up or the next one would start past the deadline.
        """
        deadline = None if timeout is None else clock() + timeout
        failures = 0
        while True:
            remaining = None if deadline is None else max(deadline - clock(), 0.0)
            try:
                result = await attempt(remaining)
            except grpc.RpcError as err:
                failures += 1
                if err.code() not in self.retry_on or failures >= self.attempts:
                    raise
                delay = self.backoff.compute(failures)
                if deadline is not None and clock() + delay >= deadline:
                    raise
                await sleep(delay)
            else:
                self.backoff.reset()
                return result
