"""Backoff and RetryPolicy, without a server."""

from __future__ import annotations

import random

import grpc
import pytest

from kvstore.client import Backoff, RetryPolicy


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "boom")


def test_backoff_grows_is_capped_and_jittered() -> None:
    backoff = Backoff(base=0.1, cap=1.0, rng=random.Random(7))
    for failures, ceiling in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (500, 1.0)]:
        delays = {backoff.compute(failures) for _ in range(50)}
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(delays) > 1
    backoff.reset()
    assert backoff.compute(0) <= 0.1


class Attempts:
    def __init__(self, *codes: grpc.StatusCode) -> None:
        self.codes = list(codes)
        self.timeouts: list[float | None] = []

    async def __call__(self, timeout: float | None) -> str:  # noqa: ASYNC109
        self.timeouts.append(timeout)
        if self.codes:
            raise rpc_error(self.codes.pop(0))
        return "ok"


async def no_sleep(delay: float) -> None:
    pass


async def test_retries_unavailable_then_succeeds() -> None:
    attempt = Attempts(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert await RetryPolicy(attempts=3).call(attempt, 10.0, sleep=no_sleep) == "ok"
    assert len(attempt.timeouts) == 3


async def test_gives_up_after_attempts() -> None:
    attempt = Attempts(*[grpc.StatusCode.UNAVAILABLE] * 5)
    with pytest.raises(grpc.aio.AioRpcError):
        await RetryPolicy(attempts=3).call(attempt, None, sleep=no_sleep)
    assert len(attempt.timeouts) == 3


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INTERNAL]
)
async def test_no_retry_on_other_codes(code: grpc.StatusCode) -> None:
    attempt = Attempts(code)
    with pytest.raises(grpc.aio.AioRpcError):
        await RetryPolicy().call(attempt, None, sleep=no_sleep)
    assert len(attempt.timeouts) == 1


async def test_timeout_is_a_deadline_for_all_attempts() -> None:
    now = [0.0]

    async def sleep(delay: float) -> None:
        now[0] += delay

    attempt = Attempts(*[grpc.StatusCode.UNAVAILABLE] * 10)
    policy = RetryPolicy(attempts=10, backoff=Backoff(base=1.0, cap=1.0))
    with pytest.raises(grpc.aio.AioRpcError):
        await policy.call(attempt, 2.0, sleep=sleep, clock=lambda: now[0])
    assert now[0] < 2.0
    assert attempt.timeouts[0] == 2.0
    assert all(t is not None and t <= 2.0 for t in attempt.timeouts)
    assert attempt.timeouts == sorted((t or 0.0 for t in attempt.timeouts), reverse=True)
