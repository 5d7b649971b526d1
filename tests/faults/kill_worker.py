"""Runner processes to be SIGKILLed, many per second, at random moments.

A fresh Python process per kill costs about half a second (interpreter,
numpy, grpc), so 1,000 of them in sequence would take many minutes.
Instead `KillCampaign` starts a ``forkserver`` once, which imports this
module (grpc, numpy, the client SDK, no torch) and never opens a channel;
every victim is a fork of it (a few milliseconds), builds its own client,
lease and pool mapping, and then runs random operations in a loop until the
parent SIGKILLs it:

* a pinned lookup, the bytes read through the mapping and compared with
  `workload.expected_block` (``PHASE_READ``), the pins held for a while;
* a full `Client.store` whose block supplier is where the kill lands
  mid-copy (``PHASE_WRITE``), between Reserve and Commit;
* a raw Reserve plus half a block written and never committed
  (``PHASE_HALF_WRITTEN``), as in `tests.e2e.runner`.

Each victim publishes its current phase and its counters in shared memory,
so the parent knows where each kill landed and how many blocks the victims
verified (and how many differed, which must be none) even though no victim
ever exits on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import random
import signal
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.client import Client, Hit, Namespace
from kvstore.types import BlockHash
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from tests.e2e.workload import (
    LAYOUT,
    MODEL_ID,
    expected_block,
    system_prompt,
    tokens,
    verify_ready_blocks,
)
from tests.replies import entries_of

PHASES = (
    "connect",  # 0: channel, lease, RegisterNamespace, AttachPool
    "idle",  # 1
    "lookup",  # 2: the pinned Lookup RPC in flight
    "read",  # 3: reading pinned bytes through the mapping
    "hold_pins",  # 4: pins held, doing nothing
    "reserve",  # 5: Reserve RPC in flight (inside Client.store)
    "write",  # 6: copying a block into a reserved slot
    "commit",  # 7: after the last copy, Commit in flight
    "half_written",  # 8: reserved, half a block written, never committed
    "release",  # 9: Release RPC in flight
)
PHASE = {name: i for i, name in enumerate(PHASES)}

SYSTEMS = 4
USERS = 16
CAPACITY_BLOCKS = 512


def prompts() -> list[list[int]]:
    """Every prompt the victims use: 4 system prompts x 16 user prompts (7 blocks each)."""
    systems = [system_prompt(f"kill/{s}", 72) for s in range(SYSTEMS)]
    users = [tokens(f"kill-user/{u}", 40) for u in range(USERS)]
    return [s + u for s in systems for u in users]


class Board:
    """Shared memory the victims write and the campaign reads, one row per in-flight victim.

    An anonymous shared mapping made before the forks: every victim inherits
    it, so its phase and counters survive its SIGKILL.
    """

    def __init__(self, rows: int) -> None:
        self._mem = mmap.mmap(-1, 32 * rows)
        table = np.frombuffer(self._mem, dtype=np.int64).reshape(rows, 4)
        self.phase = table[:, 0]
        """Current phase of the victim in each row (an index into `PHASES`; -1: it failed)."""
        self.verified = table[:, 1]
        """Blocks read back and compared, per row (accumulates over the row's victims)."""
        self.mismatches = table[:, 2]
        """Blocks whose bytes differed from `expected_block` (must stay 0)."""
        self.committed = table[:, 3]
        """Blocks that victims committed."""


def victim_main(target: str, row: int, seed: int, lease_ttl: float, board: Board) -> None:
    """Body of a victim process (a fresh fork of the campaign process); never returns."""
    code = 0
    try:
        asyncio.run(_victim(target, row, seed, lease_ttl, board))
    except BaseException:  # a victim should be killed, not fail
        board.phase[row] = -1
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)  # no atexit handlers or buffers inherited from the campaign


async def _victim(target: str, row: int, seed: int, lease_ttl: float, board: Board) -> None:
    rng = random.Random(seed)
    all_prompts = prompts()

    def set_phase(name: str) -> None:
        board.phase[row] = PHASE[name]

    async with Client(target, lease_ttl=lease_ttl, timeout=10.0, client_name="victim") as client:
        ns = await client.register_namespace(
            MODEL_ID, LAYOUT, capacity_bytes=CAPACITY_BLOCKS * LAYOUT.block_bytes
        )
        await client.lease.current()
        give_up = time.monotonic() + 30.0  # the parent kills long before
        while time.monotonic() < give_up:
            set_phase("idle")
            prompt = rng.choice(all_prompts)
            chain = ns.hash(prompt)
            roll = rng.random()
            if roll < 0.45:
                set_phase("lookup")
                hit = await client.lookup(ns, hashes=chain, pin=True)
                set_phase("read")
                _verify(hit, chain, row, board)
                set_phase("hold_pins")
                await asyncio.sleep(rng.uniform(0.0, 0.02))
                set_phase("release")
                await client.release(hit)
            elif roll < 0.85:
                set_phase("reserve")

                def supply(index: int, chain: Sequence[BlockHash] = chain) -> np.ndarray:
                    set_phase("write")
                    time.sleep(0.001)  # a copy takes time; this is where mid-write kills land
                    return expected_block(chain[index])

                result = await client.store(ns, hashes=chain, blocks=supply)
                board.committed[row] += result.committed
            else:
                await _half_write(client, ns, chain, set_phase)
                await asyncio.sleep(rng.uniform(0.0, 0.05))


def _verify(hit: Hit, chain: Sequence[bytes], row: int, board: Board) -> None:
    views = hit.numpy_views()
    for loc, view, want in zip(hit.blocks, views, chain, strict=False):
        raw = view.reshape(-1).view(np.uint8)
        if loc.hash != want or not np.array_equal(raw, expected_block(loc.hash)):
            board.mismatches[row] += 1
        board.verified[row] += 1
    del views


async def _half_write(client: Client, ns: Namespace, chain: Sequence[bytes], set_phase) -> None:
    """Reserve the chain's missing blocks under the client's lease; write half of the first."""
    lease_id, _ = await client.lease.current()
    set_phase("reserve")
    stub = kvstore_pb2_grpc.KVStoreStub(client._rpc.channel)
    resp = await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns.id, lease_id=lease_id, packed_hashes=b"".join(chain)),
        timeout=10.0,
    )
    entries = [e for e in entries_of(resp) if e.status == pb.RESERVE_STATUS_RESERVED]
    set_phase("half_written")
    if entries and ns.mapping is not None:
        target = ns.mapping.buffer(entries[0].location.slot)
        half = len(target) // 2
        target[:half] = bytes(expected_block(entries[0].hash)[:half])
        del target


@dataclass
class CampaignResult:
    """What a kill campaign did."""

    kills: int = 0
    """Victims SIGKILLed (each confirmed dead with exit status -9)."""
    by_phase: Counter[str] = field(default_factory=Counter)
    """Where the kills landed."""
    verified: int = 0
    """Blocks the victims read back and compared."""
    mismatches: int = 0
    """Of those, blocks whose bytes were wrong."""
    committed: int = 0
    """Blocks the victims committed."""
    failed: int = 0
    """Victims that died on their own (an exception) before being killed."""
    seconds: float = 0.0
    """Wall time of the campaign."""
    startup_seconds: float = 0.0
    """Sum over victims of the time from spawn to holding a lease and a mapping."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "kills": self.kills,
            "by_phase": dict(sorted(self.by_phase.items())),
            "verified_blocks": self.verified,
            "mismatches": self.mismatches,
            "committed_blocks": self.committed,
            "failed": self.failed,
            "seconds": round(self.seconds, 1),
            "mean_startup_ms": round(1000 * self.startup_seconds / max(self.kills, 1), 1),
        }


def run_campaign(
    target: str,
    *,
    kills: int,
    in_flight: int = 4,
    lease_ttl: float = 1.0,
    max_delay: float = 0.08,
    seed: int = 0,
    ready_timeout: float = 20.0,
) -> CampaignResult:
    """SIGKILL ``kills`` victims, ``in_flight`` at a time, each at a random moment.

    Must run in a process that has opened no gRPC channel (victims are plain
    forks of it): `main` is that process. A victim is killed
    ``uniform(0, max_delay)`` seconds after it holds its lease and mapping
    (so kills land inside operations), or, one victim in ten, at a random
    moment of its startup.
    """
    board = Board(in_flight)
    rng = random.Random(f"kill-campaign/{seed}")
    result = CampaignResult()
    rows: list[tuple[int, float, float | None] | None] = [None] * in_flight
    started = time.monotonic()
    spawned = 0

    def spawn(row: int) -> None:
        nonlocal spawned
        spawned += 1
        board.phase[row] = PHASE["connect"]
        victim_seed = rng.getrandbits(64)
        pid = os.fork()
        if pid == 0:  # the victim
            victim_main(target, row, victim_seed, lease_ttl, board)
        born = time.monotonic()
        kill_at = born + rng.uniform(0.0, 0.05) if rng.random() < 0.1 else None
        rows[row] = (pid, born, kill_at)

    def reap(pid: int) -> int:
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)

    try:
        while result.kills < kills:
            for row in range(in_flight):
                slot = rows[row]
                if slot is None:
                    if spawned < kills:
                        spawn(row)
                    continue
                pid, born, kill_at = slot
                now = time.monotonic()
                if board.phase[row] == -1 or os.waitpid(pid, os.WNOHANG) != (0, 0):
                    rows[row] = None
                    result.failed += 1
                    raise AssertionError(f"victim {pid} exited on its own (see stderr)")
                if kill_at is None:
                    if board.phase[row] != PHASE["connect"]:
                        # Ready (lease and mapping held): draw the kill time from now.
                        rows[row] = (pid, born, now + rng.uniform(0.0, max_delay))
                        result.startup_seconds += now - born
                    elif now - born > ready_timeout:
                        raise AssertionError(f"victim {pid} did not connect in {ready_timeout} s")
                    continue
                if now < kill_at:
                    continue
                where = PHASES[board.phase[row]]
                os.kill(pid, signal.SIGKILL)
                rows[row] = None
                code = reap(pid)
                if code != -signal.SIGKILL:
                    raise AssertionError(f"victim {pid} exit code {code}, not -9 (SIGKILL)")
                result.kills += 1
                result.by_phase[where] += 1
            time.sleep(0.001)
    finally:
        for slot in rows:
            if slot is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot[0], signal.SIGKILL)
                reap(slot[0])
        result.seconds = time.monotonic() - started
        result.verified = int(board.verified.sum())
        result.mismatches = int(board.mismatches.sum())
        result.committed = int(board.committed.sum())
    return result


def verify_node(target: str) -> dict[str, Any]:
    """Read every cached block of the victims' namespace back and compare its bytes.

    A fresh client looks up (pinned) every prompt the victims used and
    compares the hit blocks with `expected_block`; then every READY block
    that ListBlocks names, reachable or orphaned, is read through the mapping
    at its slot and compared too. Run it once the victims are gone.
    """
    return asyncio.run(_verify_node(target))


async def _verify_node(target: str) -> dict[str, Any]:
    hit_blocks = 0
    mismatches = 0
    async with Client(target, client_name="verifier") as client:
        ns = await client.register_namespace(MODEL_ID, LAYOUT)
        for prompt in prompts():
            chain = ns.hash(prompt)
            hit = await client.lookup(ns, hashes=chain, pin=True)
            views = hit.numpy_views()
            for loc, view in zip(hit.blocks, views, strict=True):
                if not np.array_equal(view.reshape(-1).view(np.uint8), expected_block(loc.hash)):
                    mismatches += 1
                hit_blocks += 1
            del views
            await client.release(hit)
        ready, corrupt = await verify_ready_blocks(target, ns)
        mismatches += corrupt
    return {"hit_blocks": hit_blocks, "ready_blocks": ready, "mismatches": mismatches}


def seed_cache(target: str, share: float = 0.5) -> int:
    """Store ``share`` of the victims' prompts, so their lookups hit and kills land mid-read."""
    return asyncio.run(_seed_cache(target, share))


async def _seed_cache(target: str, share: float) -> int:
    stored = 0
    async with Client(target, client_name="seeder") as client:
        ns = await client.register_namespace(
            MODEL_ID, LAYOUT, capacity_bytes=CAPACITY_BLOCKS * LAYOUT.block_bytes
        )
        all_prompts = prompts()
        for prompt in all_prompts[: int(len(all_prompts) * share)]:
            chain = ns.hash(prompt)
            result = await client.store(
                ns, hashes=chain, blocks=lambda i, c=chain: expected_block(c[i])
            )
            stored += result.committed
    return stored


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m tests.faults.kill_worker --target HOST:PORT --kills N``: one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m tests.faults.kill_worker")
    parser.add_argument("--target", required=True)
    parser.add_argument("--kills", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--lease-ttl", type=float, default=1.0)
    parser.add_argument("--max-delay", type=float, default=0.08)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = run_campaign(
        args.target,
        kills=args.kills,
        in_flight=args.in_flight,
        lease_ttl=args.lease_ttl,
        max_delay=args.max_delay,
        seed=args.seed,
    )
    print(json.dumps(result.as_dict(), sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
