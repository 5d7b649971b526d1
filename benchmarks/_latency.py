"""The control-plane figures of `bench_service`: Lookup+pin and Release against Ping.

A pinned Lookup of a chain through the SDK, then its Release, against a
``Ping`` echoing as many bytes as the Lookup request, at each concurrency
(asyncio tasks sharing one client and channel): latency, throughput, the
Release calls per pair, and the node's CPU time per pair and per Ping (read
from ``/proc``). `bench_uds` runs them again over the node's Unix socket.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks._stats import summary_us
from kvstore.client import Client, Hit, Namespace
from kvstore.client.methods import LOOKUP
from kvstore.client.releases import new_release_id
from kvstore.client.replies import hit_from_proto
from kvstore.layout import KVLayout
from kvstore.types import BlockHash, LeaseId
from kvstore.v1 import kvstore_pb2 as pb

TENANT = "bench"
"""The benchmark's tenant (`bench_service` uses the same)."""


async def run_concurrent(
    op: Callable[[], Awaitable[float]], concurrency: int, per_task: int
) -> tuple[list[float], float]:
    """``concurrency`` tasks each running ``op`` ``per_task`` times; latencies and wall time.

    ``op`` returns the latency it measured (it may time only part of itself).
    """
    latencies: list[float] = []

    async def task() -> None:
        for _ in range(per_task):
            latencies.append(await op())

    start = time.perf_counter()
    await asyncio.gather(*(task() for _ in range(concurrency)))
    return latencies, time.perf_counter() - start


# --- latency ---------------------------------------------------------------------


def node_cpu_seconds(pid: int | None) -> float | None:
    """The node process's user + system CPU seconds so far (None off Linux)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_us_per_op(before: float | None, after: float | None, ops: int) -> float | None:
    return None if before is None or after is None else round((after - before) / ops * 1e6, 1)


async def bench_latency(
    client: Client, ns: Namespace, tokens: list[int], chain: list[BlockHash], args: Any
) -> dict[str, Any]:
    lease_id, generation = await client.lease.current()
    requests = {
        "hashes": pb.LookupRequest(
            namespace_id=ns.id, lease_id=lease_id, pin=True, packed_hashes=b"".join(chain)
        ),
        "tokens": pb.LookupRequest(namespace_id=ns.id, lease_id=lease_id, pin=True, tokens=tokens),
        "tokens_sent": pb.LookupRequest(
            namespace_id=ns.id, lease_id=lease_id, pin=True, tokens=tokens
        ),
    }
    out: dict[str, Any] = {}
    for mode, request in requests.items():
        size = request.ByteSize()
        payload = os.urandom(size)
        release_lat: list[float] = []

        async def lookup_pin(mode: str = mode, release_lat: list[float] = release_lat) -> float:
            start = time.perf_counter()
            if mode == "hashes":
                hit = await client.lookup(ns, hashes=chain, pin=True)
            elif mode == "tokens":  # the SDK hashes them and sends the chain
                hit = await client.lookup(ns, tokens, pin=True)
            else:  # the tokens themselves, for the node to hash (what grpcurl sends)
                hit = await lookup_tokens_sent(client, ns, tokens, lease_id, generation)
            looked = time.perf_counter()
            if hit.hit_blocks != len(chain):
                raise RuntimeError(f"expected a full hit, got {hit.hit_blocks}/{len(chain)}")
            await client.release(hit)
            release_lat.append(time.perf_counter() - looked)
            return looked - start

        async def ping(payload: bytes = payload) -> float:
            start = time.perf_counter()
            echoed = await client.ping(payload)
            elapsed = time.perf_counter() - start
            if len(echoed) != len(payload):
                raise RuntimeError("Ping echoed another payload")
            return elapsed

        result: dict[str, Any] = {"request_bytes": size, "ping_payload_bytes": len(payload)}
        for concurrency in args.concurrency:
            per_task = max(1, args.iterations // concurrency)
            for op in (lookup_pin, ping):  # warm up both paths
                await run_concurrent(op, concurrency, max(1, per_task // 10))
            release_lat.clear()
            releases = client._releases
            calls, carried = releases.calls, getattr(releases, "carried", 0)
            cpu0 = node_cpu_seconds(getattr(args, "node_pid", None))
            look, look_wall = await run_concurrent(lookup_pin, concurrency, per_task)
            cpu1 = node_cpu_seconds(getattr(args, "node_pid", None))
            calls, carried = releases.calls - calls, getattr(releases, "carried", 0) - carried
            pings, ping_wall = await run_concurrent(ping, concurrency, per_task)
            cpu2 = node_cpu_seconds(getattr(args, "node_pid", None))
            pair_cpu = cpu_us_per_op(cpu0, cpu1, len(look))
            ping_cpu = cpu_us_per_op(cpu1, cpu2, len(pings))
            lookup_stats = summary_us(look)
            ping_stats = summary_us(pings)
            pairs_per_s = len(look) / look_wall
            result[f"c{concurrency}"] = {
                "ops": len(look),
                "lookup_pin": lookup_stats,
                "release": summary_us(release_lat),
                "ping": ping_stats,
                "lookup_over_ping_median": round(
                    lookup_stats["median_us"] / ping_stats["median_us"], 2
                ),
                "lookup_over_ping_p99": round(lookup_stats["p99_us"] / ping_stats["p99_us"], 2),
                "lookup_pin_release_ops_per_s": round(pairs_per_s, 1),
                "ping_ops_per_s": round(len(pings) / ping_wall, 1),
                "pairs_over_ping_ops": round(pairs_per_s * ping_wall / len(pings), 2),
                # Release calls per pair, and the releases that rode on a Lookup instead
                # (LookupRequest.release): a pair is 1 + release_calls_per_pair calls.
                "release_calls_per_pair": round(calls / len(look), 2),
                "releases_carried_per_pair": round(carried / len(look), 2),
                # The node's CPU time (user + system, all its threads) per pair and per
                # Ping: what bounds its throughput, and little moved by other load.
                "node_cpu_us_per_pair": pair_cpu,
                "node_cpu_us_per_ping": ping_cpu,
                "pair_cpu_over_ping_cpu": (
                    round(pair_cpu / ping_cpu, 2) if pair_cpu and ping_cpu else None
                ),
            }
        out[mode] = result
    return out


async def lookup_tokens_sent(
    client: Client, ns: Namespace, tokens: list[int], lease_id: int, generation: int
) -> Hit:
    """A pinned Lookup that sends the tokens and lets the node hash them.

    What `Client.lookup` did before it hashed prompts itself, and what a
    client without the SDK does: the node's cost of hashing, measured.
    """
    request = pb.LookupRequest(
        namespace_id=ns.id,
        lease_id=lease_id,
        pin=True,
        tokens=tokens,
        release_id=new_release_id(),  # names its pins, as `Client.lookup` does
    )
    resp = await client._rpc.call(LOOKUP, request, None, idempotent=False)
    hit = hit_from_proto(ns, resp, generation, LeaseId(lease_id))
    hit.release.release_id = request.release_id
    return hit


async def bench_uds(
    uds_target: str, layout: KVLayout, tokens: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """The latency runs again over the node's Unix-domain socket (``uds_path``).

    A second client on the ``unix:`` target, its own lease; the chain is already
    stored. Its Ping (over the same socket) is the baseline of these figures.
    """
    async with Client(uds_target, tenant=TENANT, timeout=60.0, lease_ttl=120.0) as client:
        ns = await client.register_namespace("bench-service", layout)
        chain = ns.hash(tokens)
        out = {"lookup_vs_ping": await bench_latency(client, ns, tokens, chain, args)}
        short = min(args.short_blocks, len(chain))
        out[f"lookup_vs_ping_{short}_blocks"] = await bench_latency(
            client, ns, tokens[: short * args.block_size], chain[:short], args
        )
    return out


def over_tcp_ping(uds: dict[str, Any], tcp: dict[str, Any]) -> None:
    """Add to each UDS figure its ratio to the TCP Ping of the same case and run."""
    for section, modes in uds.items():
        for mode, result in modes.items():
            for key, figures in result.items():
                if not key.startswith("c"):
                    continue
                tcp_ping = tcp[section][mode][key]["ping"]
                figures["lookup_over_tcp_ping_median"] = round(
                    figures["lookup_pin"]["median_us"] / tcp_ping["median_us"], 2
                )
                figures["pairs_over_tcp_ping_ops"] = round(
                    figures["lookup_pin_release_ops_per_s"]
                    / tcp[section][mode][key]["ping_ops_per_s"],
                    2,
                )
