"""benchmarks/bench_scaling.py: how it reads a process's CPU use and sizes the Ping baseline."""

from __future__ import annotations

import os
import time

import pytest

from benchmarks import bench_scaling
from kvstore.api import wire
from kvstore.v1 import kvstore_pb2 as pb

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")


def test_stat_cpu_reads_utime_and_stime_after_a_name_with_spaces_and_parentheses() -> None:
    tick = bench_scaling.CLK_TCK
    fields = ["S"] + ["0"] * 10 + [str(3 * tick), str(2 * tick)] + ["0"] * 30
    stat = "4242 (a (weird) name) " + " ".join(fields)
    assert bench_scaling.stat_cpu(stat) == 5.0


def test_cpu_seconds_grows_while_this_process_computes() -> None:
    before = bench_scaling.cpu_seconds(os.getpid())
    deadline = time.monotonic() + 10.0
    while bench_scaling.cpu_seconds(os.getpid()) <= before:  # one clock tick of CPU
        assert time.monotonic() < deadline, "no CPU time counted in 10 s of computing"
        sum(range(10_000))


def test_busy_threads_names_the_main_thread_and_drops_idle_ones() -> None:
    before = {100: ("python", 1.0), 101: ("event_engine", 0.5), 102: ("idle", 0.2)}
    after = {100: ("python", 2.0), 101: ("event_engine", 0.7), 102: ("idle", 0.2)}
    assert bench_scaling.busy_threads(before, after, 2.0) == {
        "main (event loop)": 0.5,
        "event_engine": 0.1,
    }


def test_thread_cpu_lists_this_process_s_threads() -> None:
    threads = bench_scaling.thread_cpu(os.getpid())
    assert os.getpid() in threads  # the main thread's id is the pid


def test_ping_payload_is_as_large_as_the_sdk_s_lookup_request() -> None:
    chain = [i.to_bytes(32, "big") for i in range(512)]
    request = pb.LookupRequest(
        namespace_id="ns-1",
        lease_id=1,
        pin=True,
        packed_hashes=wire.pack_hashes(chain),
    )
    assert bench_scaling.lookup_request_bytes("ns-1", chain) == request.ByteSize()


def test_schedstat_counts_this_thread_s_time_on_a_cpu() -> None:
    running, waiting = bench_scaling.schedstat(os.getpid())
    if running == 0.0 and waiting == 0.0:
        pytest.skip("this kernel has no schedstat")
    assert running > 0.0
    assert waiting >= 0.0
