"""A model-runner stand-in for the e2e tests: ``python -m tests.e2e.runner CMD ...``.

Each runner is its own process using the real client SDK (`kvstore.client`):
it maps the node's pool, writes blocks into it and reads them back through
its own mapping. Results are JSON objects, one per line, on stdout; logs go
to stderr.

Commands:

* ``ops --program JSON``: run a list of ``store`` / ``lookup`` operations in
  order and print ``{"results": [...]}``. An operation is
  ``{"op": "store" | "lookup", "tokens": [...]}`` plus optional ``"hashes":
  true`` (send the locally computed chain instead of tokens), ``"pin"``
  (lookup, default true), ``"torch"`` (also check torch views) or
  ``"raw_hashes": [hex, ...]`` (look up these hashes as given). A pinned lookup checks every hit
  block byte for byte against `workload.expected_block` of its hash (inside
  this process, from this process's mapping), then releases it.
* ``hold --pin-tokens JSON [--reserve-tokens JSON] [--wait-stdin]``: pin a
  prefix, optionally reserve (WRITING) the missing blocks of a longer prompt
  and half-write the first of them, print ``{"event": "ready", ...}``, then
  either sleep (to be killed) or wait for a line on stdin, re-check the
  pinned bytes, release and print ``{"event": "done", ...}``.
* ``worker --seed N --duration S``: loop over lookups (pinned, verified) and
  stores of prompts made of a few shared system prompts and user prompts
  (from a small shared pool, or unique to this runner); print counters.
  With ``--tolerate-outage`` an iteration that fails with a `KVStoreError`
  (the node was killed, restarting) is counted in ``errors`` and the loop
  goes on (the first one also prints ``{"event": "outage"}``); the epochs
  the client saw are counted in ``epochs``.
* ``session``: read one JSON operation per stdin line (as in ``ops``) and
  print ``{"event": "result", ...}`` for each, with the client's ``epoch``,
  the epoch of the namespace's mapping and lost leases; a failing operation
  prints ``{"event": "result", "error": "<class name>"}`` and the session
  goes on (the node may be down). An empty line or EOF ends it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from kvstore.client import Client, Hit, Namespace
from kvstore.errors import KVStoreError
from kvstore.types import BlockHash
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from tests.e2e.workload import (
    LAYOUT,
    MODEL_ID,
    block_digest,
    expected_block,
    system_prompt,
    tokens,
)
from tests.replies import entries_of

TENANT_HEADER = "x-kvstore-tenant"


def emit(doc: dict[str, Any]) -> None:
    """Print one JSON result line."""
    print(json.dumps(doc, sort_keys=True), flush=True)


def hexes(hashes: Sequence[bytes]) -> list[str]:
    return [bytes(h).hex() for h in hashes]


def make_client(args: argparse.Namespace) -> Client:
    return Client(
        args.target,
        tenant=args.tenant,
        lease_ttl=args.lease_ttl,
        timeout=args.timeout,
        client_name=f"e2e-{args.command}",
    )


async def register(client: Client, args: argparse.Namespace) -> Namespace:
    return await client.register_namespace(args.model, LAYOUT, capacity_bytes=args.capacity_bytes)


def verify_hit(hit: Hit, chain: Sequence[bytes], *, use_torch: bool = False) -> dict[str, Any]:
    """Compare every hit block, read through this process's mapping, with its expected bytes."""
    mismatches = 0
    wrong_hash = 0
    digests: list[str] = []
    views = hit.numpy_views()
    for i, (loc, view) in enumerate(zip(hit.blocks, views, strict=True)):
        if i >= len(chain) or loc.hash != chain[i]:
            wrong_hash += 1
        raw = view.reshape(-1).view(np.uint8)
        if not np.array_equal(raw, expected_block(loc.hash)):
            mismatches += 1
        digests.append(block_digest(raw))
    del views  # the mapping cannot unmap while views are alive
    torch_mismatches = 0
    if use_torch:
        import torch

        for loc, tensor in zip(hit.blocks, hit.torch_views(), strict=True):
            if tensor.dtype != torch.float16 or tuple(tensor.shape) != LAYOUT.block_shape:
                torch_mismatches += 1
                continue
            raw_t = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            if not np.array_equal(raw_t, expected_block(loc.hash)):
                torch_mismatches += 1
    return {
        "mismatches": mismatches,
        "torch_mismatches": torch_mismatches,
        "wrong_hash": wrong_hash,
        "verified": len(hit.blocks),
        "digests": digests,
    }


async def op_store(client: Client, ns: Namespace, op: dict[str, Any]) -> dict[str, Any]:
    prompt: list[int] = op["tokens"]
    chain = ns.hash(prompt)
    written: dict[int, str] = {}

    def block(index: int) -> np.ndarray:
        data = expected_block(chain[index])
        written[index] = block_digest(data)
        return data

    if op.get("hashes"):
        result = await client.store(ns, hashes=chain, blocks=block)
    else:
        result = await client.store(ns, prompt, blocks=block)
    return {
        "op": "store",
        "reserved": result.reserved,
        "hit": result.hit,
        "in_flight": result.in_flight,
        "no_room": result.no_room,
        "committed": result.committed,
        "chain": hexes(chain),
        "server_chain_matches": list(result.chain) == chain,
        "written": {str(i): d for i, d in sorted(written.items())},
    }


async def op_lookup(client: Client, ns: Namespace, op: dict[str, Any]) -> dict[str, Any]:
    prompt: list[int] = op["tokens"]
    chain = ns.hash(prompt)
    pin = op.get("pin", True)
    if "raw_hashes" in op:  # somebody else's chain (e.g. another tenant's), sent as is
        chain = [BlockHash(bytes.fromhex(h)) for h in op["raw_hashes"]]
        hit = await client.lookup(ns, hashes=chain, pin=pin)
    elif op.get("hashes"):
        hit = await client.lookup(ns, hashes=chain, pin=pin)
    else:
        hit = await client.lookup(ns, prompt, pin=pin)
    doc: dict[str, Any] = {
        "op": "lookup",
        "hit_blocks": hit.hit_blocks,
        "hit_tokens": hit.hit_tokens,
        "query_tokens": hit.query_tokens,
        "miss_reason": hit.miss_reason.name,
        "pinned": hit.pinned,
        "chain": hexes(chain),
        "hit_hashes": hexes(hit.hashes),
    }
    if pin:
        try:
            doc.update(verify_hit(hit, chain, use_torch=op.get("torch", False)))
        finally:
            doc["released"] = await client.release(hit)
    return doc


async def cmd_ops(args: argparse.Namespace) -> None:
    program: list[dict[str, Any]] = json.loads(args.program)
    results: list[dict[str, Any]] = []
    async with make_client(args) as client:
        ns = await register(client, args)
        for op in program:
            if op["op"] == "store":
                results.append(await op_store(client, ns, op))
            elif op["op"] == "lookup":
                results.append(await op_lookup(client, ns, op))
            else:
                raise SystemExit(f"unknown op {op['op']!r}")
    emit({"results": results, "namespace": ns.id, "capacity": ns.capacity})


async def cmd_hold(args: argparse.Namespace) -> None:
    """Pin (and optionally reserve) under this process's lease, then wait or die."""
    pin_tokens: list[int] = json.loads(args.pin_tokens)
    async with make_client(args) as client:
        ns = await register(client, args)
        chain = ns.hash(pin_tokens)
        hit = await client.lookup(ns, pin_tokens, pin=True)
        check = verify_hit(hit, chain)
        lease_id, _ = await client.lease.current()
        reserved: list[bytes] = []
        if args.reserve_tokens:
            reserved = await reserve_and_half_write(
                args, ns, lease_id, json.loads(args.reserve_tokens)
            )
        emit(
            {
                "event": "ready",
                "pinned": hit.hit_blocks,
                "pinned_hashes": hexes(hit.hashes),
                "reserved": len(reserved),
                "reserved_hashes": hexes(reserved),
                "lease_id": lease_id,
                "mismatches": check["mismatches"],
            }
        )
        if not args.wait_stdin:
            await asyncio.sleep(args.hold_seconds)
            raise SystemExit("hold: still alive after --hold-seconds; the test should kill me")
        line = await asyncio.wait_for(asyncio.to_thread(sys.stdin.readline), args.hold_seconds)
        after = verify_hit(hit, chain)  # the pins kept the bytes in place meanwhile
        released = await client.release(hit)
        emit(
            {
                "event": "done",
                "got": line.strip(),
                "mismatches": after["mismatches"],
                "verified": after["verified"],
                "released": released,
                "lease_lost": client.lease.lost,
            }
        )


async def reserve_and_half_write(
    args: argparse.Namespace, ns: Namespace, lease_id: int, prompt: list[int]
) -> list[bytes]:
    """Reserve the missing blocks of ``prompt`` and write half of the first one.

    The SDK's `Client.store` always commits or aborts what it reserves, so a
    runner caught mid-write is made here with the raw ``Reserve`` RPC under
    the client's own lease, and its bytes go into the mapped slot.
    """
    metadata = ((TENANT_HEADER, args.tenant),) if args.tenant else ()
    async with grpc.aio.insecure_channel(args.target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        resp = await stub.Reserve(
            pb.ReserveRequest(
                namespace_id=ns.id, lease_id=lease_id, packed_hashes=b"".join(ns.hash(prompt))
            ),
            timeout=args.timeout,
            metadata=metadata,
        )
    entries = [e for e in entries_of(resp) if e.status == pb.RESERVE_STATUS_RESERVED]
    if entries and ns.mapping is not None:
        target = ns.mapping.buffer(entries[0].location.slot)
        half = len(target) // 2
        target[:half] = bytes(expected_block(entries[0].hash)[:half])
        del target
    return [e.hash for e in entries]


def block_of(chain: Sequence[bytes]) -> Callable[[int], np.ndarray]:
    """The block supplier of a chain: ``i -> expected_block(chain[i])``."""
    return lambda index: expected_block(chain[index])


async def cmd_worker(args: argparse.Namespace) -> None:
    """Concurrent load: lookups (pinned, verified) and stores of overlapping prompts."""
    rng = random.Random(f"e2e-worker/{args.seed}")
    systems = [system_prompt(k, args.system_tokens) for k in range(args.systems)]
    counts = {
        "iterations": 0,
        "lookups": 0,
        "hit_blocks": 0,
        "miss_blocks": 0,
        "verified": 0,
        "mismatches": 0,
        "wrong_hash": 0,
        "stored_blocks": 0,
        "store_hit": 0,
        "in_flight": 0,
        "no_room": 0,
        "held_across_store": 0,
    }
    if args.tolerate_outage:
        counts["errors"] = counts["epochs"] = 0
    epochs: set[int] = set()
    async with make_client(args) as client:
        ns = await register(client, args)

        async def iteration() -> None:
            # Half the user prompts come from a small pool every runner shares (deep
            # overlapping chains, races to write the same block), half are unique.
            if rng.random() < 0.5:
                suffix = tokens(f"shared-user/{rng.randrange(args.shared_users)}", 56)
            else:
                suffix = tokens(f"{args.seed}/{counts['iterations']}", rng.randrange(8, 72))
            prompt = rng.choice(systems) + suffix
            chain: list[BlockHash] = ns.hash(prompt)
            by_hashes = rng.random() < 0.5
            hit = await (
                client.lookup(ns, hashes=chain, pin=True)
                if by_hashes
                else client.lookup(ns, prompt, pin=True)
            )
            counts["lookups"] += 1
            counts["hit_blocks"] += hit.hit_blocks
            counts["miss_blocks"] += len(chain) - hit.hit_blocks
            hold = rng.random() < 0.5  # keep the pins while storing the rest
            try:
                check = verify_hit(hit, chain)
                counts["verified"] += check["verified"]
                counts["mismatches"] += check["mismatches"]
                counts["wrong_hash"] += check["wrong_hash"]
                if not hold:
                    await client.release(hit)
                result = await client.store(ns, hashes=chain, blocks=block_of(chain))
                counts["held_across_store"] += int(hold)
            finally:
                await client.release(hit)  # a second release sends nothing
            counts["stored_blocks"] += result.committed
            counts["store_hit"] += result.hit
            counts["in_flight"] += result.in_flight
            counts["no_room"] += result.no_room

        deadline = time.monotonic() + args.duration
        while time.monotonic() < deadline and counts["iterations"] < args.max_iterations:
            counts["iterations"] += 1
            if args.tolerate_outage:
                await _outage_tolerant(client, counts, epochs, iteration)
            else:
                await iteration()
    emit(counts)


async def _outage_tolerant(client: Client, counts: dict[str, int], epochs: set[int], step) -> None:
    """Run one worker iteration; a `KVStoreError` (node down or restarting) is counted."""
    try:
        await step()
    except KVStoreError:
        if counts["errors"] == 0:
            emit({"event": "outage"})  # a test waits for this line, not a fixed time
        counts["errors"] += 1
        await asyncio.sleep(0.05)
    if client.epoch is not None:
        epochs.add(client.epoch)
    counts["epochs"] = len(epochs)


async def cmd_session(args: argparse.Namespace) -> None:
    """Operations from stdin, one JSON object a line; one result line each (see module doc)."""
    async with make_client(args) as client:
        ns: Namespace | None = None
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line.strip():
                break
            op = json.loads(line)
            doc: dict[str, Any] = {"event": "result", "op": op["op"]}
            try:
                ns = await register(client, args)  # re-registers after a restart
                if op["op"] == "store":
                    doc.update(await op_store(client, ns, op))
                elif op["op"] == "lookup":
                    doc.update(await op_lookup(client, ns, op))
                else:
                    raise SystemExit(f"unknown op {op['op']!r}")
            except KVStoreError as exc:
                doc["error"] = type(exc).__name__
                doc["message"] = str(exc)
            doc["epoch"] = client.epoch
            doc["mapping_epoch"] = ns.epoch if ns is not None else None
            doc["lease_lost"] = client.lease.lost
            emit(doc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.runner")
    parser.add_argument("--target", required=True, help="host:port of the node")
    parser.add_argument("--tenant", default=None)
    parser.add_argument("--model", default=MODEL_ID)
    parser.add_argument("--capacity-bytes", type=int, default=256 * LAYOUT.block_bytes)
    parser.add_argument("--lease-ttl", type=float, default=30.0)
    parser.add_argument("--timeout", type=float, default=10.0)
    sub = parser.add_subparsers(dest="command", required=True)
    ops = sub.add_parser("ops")
    ops.add_argument("--program", required=True, help="JSON list of operations")
    hold = sub.add_parser("hold")
    hold.add_argument("--pin-tokens", required=True)
    hold.add_argument("--reserve-tokens", default="")
    hold.add_argument("--wait-stdin", action="store_true")
    hold.add_argument("--hold-seconds", type=float, default=60.0)
    worker = sub.add_parser("worker")
    worker.add_argument("--seed", type=int, required=True)
    worker.add_argument("--duration", type=float, default=5.0)
    worker.add_argument("--max-iterations", type=int, default=100_000)
    worker.add_argument("--systems", type=int, default=3)
    worker.add_argument("--system-tokens", type=int, default=72)
    worker.add_argument("--shared-users", type=int, default=12)
    worker.add_argument("--tolerate-outage", action="store_true")
    sub.add_parser("session")
    return parser


COMMANDS = {"ops": cmd_ops, "hold": cmd_hold, "worker": cmd_worker, "session": cmd_session}


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    asyncio.run(COMMANDS[args.command](args))


if __name__ == "__main__":
    main()
