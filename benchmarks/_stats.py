"""Summaries of timings that the service benchmarks print: quantiles, GB/s, best and median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def percentile(samples: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``samples``, nearest rank."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def summary_us(samples: list[float]) -> dict[str, float]:
    """Median, p99 and mean of latencies given in seconds, in microseconds."""
    return {
        "median_us": round(statistics.median(samples) * 1e6, 1),
        "p99_us": round(percentile(samples, 0.99) * 1e6, 1),
        "mean_us": round(statistics.fmean(samples) * 1e6, 1),
    }


def median_call_us(fn: Callable[[], None], iterations: int) -> float:
    """Median microseconds of one call of ``fn`` over ``iterations`` calls (after a warm-up)."""
    fn()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


def gbps(nbytes: int, seconds: float) -> float:
    """Gigabytes per second of ``nbytes`` moved in ``seconds``."""
    return round(nbytes / seconds / 1e9, 3)


def best_and_median(runs: list[dict[str, float]], nbytes: int) -> dict[str, Any]:
    """Per phase: best and median milliseconds; GB/s of the copy and of the whole."""
    out: dict[str, Any] = {}
    for phase in runs[0]:
        values = [r[phase] for r in runs]
        out[f"{phase}_ms"] = {
            "best": round(min(values) * 1e3, 2),
            "median": round(statistics.median(values) * 1e3, 2),
        }
    out["copy_gbps_best"] = gbps(nbytes, min(r["copy"] for r in runs))
    out["copy_gbps_median"] = gbps(nbytes, statistics.median(r["copy"] for r in runs))
    out["end_to_end_gbps_median"] = gbps(nbytes, statistics.median(r["total"] for r in runs))
    return out
