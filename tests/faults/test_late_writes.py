"""A writer process paused past its lease and its slot's quarantine, then resumed
mid-copy (issue 40, item 1), against a real ``kvstore-server`` process.

Writer A (`tests.faults.late_writer`) reserves the namespace's only slot under
a 1 s lease and is SIGSTOPped where its copy begins. Its lease expires, the
slot's quarantine (0.5 s here) ends, writer B stores its own block into the
same slot and commits it; then A is continued and its copy lands on B's
block. The node moved no stamp (nothing was freed), so only a checksum can
see it: with the default settings the reader's load (`Hit.copy_into`)
refuses the block, reports it with its release, and the node drops it. No
reader ever uses A's bytes under B's hash.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from benchmarks._server import ServerProcess
from kvstore.client import Client
from kvstore.client.errors import BlocksMoved
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from tests.client.blocks import LAYOUT
from tests.e2e.processes import ROOT, shm_parent
from tests.faults.late_writer import LATE_BYTE, TENANT

pytestmark = pytest.mark.e2e

TOKENS = list(range(LAYOUT.block_size))


@pytest.fixture
def quick_node() -> Iterator[ServerProcess]:
    """A node whose write quarantine is short, so the test waits half a second."""
    with tempfile.TemporaryDirectory(prefix="kvstore-late-", dir=shm_parent()) as shm:
        server = ServerProcess.start(
            shm, capacity="64MiB", extra_args=("--write-quarantine-seconds", "0.5")
        )
        try:
            yield server
        finally:
            server.stop()


async def store_when_free(kv: Client, ns: object, block: np.ndarray) -> None:
    """Store ``block`` as soon as the only slot is free (A's lease gone, quarantine over)."""
    for _ in range(200):
        if (await kv.store(ns, TOKENS, block[None, :])).committed == 1:  # type: ignore[arg-type]
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the slot never came free")


def start_paused_writer(target: str) -> tuple[subprocess.Popen[str], int]:
    """Writer A, SIGSTOPped where its copy begins; and the slot it reserved."""
    writer = subprocess.Popen(
        [
            sys.executable, "-m", "tests.faults.late_writer",
            "--target", target, "--tokens", ",".join(map(str, TOKENS)),
        ],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert writer.stdout is not None
    slot_line = writer.stdout.readline()
    assert writer.stdout.readline() == "ready\n", writer.stderr.read() if writer.stderr else ""
    os.kill(writer.pid, signal.SIGSTOP)
    return writer, int(slot_line.split()[1])


def resume(writer: subprocess.Popen[str]) -> None:
    """Continue writer A: its copy lands; it exits without a commit."""
    os.kill(writer.pid, signal.SIGCONT)
    out, err = writer.communicate(timeout=30)
    assert "wrote" in out and writer.returncode == 0, err


def stop(writer: subprocess.Popen[str]) -> None:
    if writer.poll() is None:
        os.kill(writer.pid, signal.SIGCONT)
        writer.kill()
        writer.wait(10)


async def test_a_writer_paused_past_its_lease_and_quarantine_never_reaches_a_reader(
    quick_node: ServerProcess,
) -> None:
    writer, a_slot = start_paused_writer(quick_node.target)
    try:
        async with Client(quick_node.target, tenant=TENANT, timeout=5.0) as kv:
            ns = await kv.register_namespace(
                "late-model", LAYOUT, capacity_bytes=LAYOUT.block_bytes
            )
            b_block = np.arange(LAYOUT.block_bytes, dtype=np.uint8)  # B's bytes: never 0xEE
            await store_when_free(kv, ns, b_block)  # A's lease expired, the quarantine ended
            hit = await kv.lookup(ns, TOKENS, pin=True)
            assert hit.hit_blocks == 1 and int(hit.slots[0]) == a_slot  # B took A's slot
            await kv.release(hit)

            resume(writer)  # A's copy lands on B's committed block

            hit = await kv.lookup(ns, TOKENS, pin=True)
            assert hit.hit_blocks == 1
            assert bytes(hit.buffers()[0][:4]) == bytes([LATE_BYTE]) * 4  # it did land
            loaded = np.zeros(LAYOUT.block_bytes, np.uint8)
            with pytest.raises(BlocksMoved) as err_info:  # the default settings refuse it
                hit.copy_into(loaded)
            assert err_info.value.corrupt == (0,) and err_info.value.intact == 0
            await kv.release(hit, corrupt=err_info.value.corrupt)
            assert (await kv.lookup(ns, TOKENS)).hit_blocks == 0  # dropped: a miss, recomputed
    finally:
        stop(writer)


async def test_a_commit_without_checksums_is_refused_by_a_real_node(
    quick_node: ServerProcess,
) -> None:
    """Issue 40, item 3, against the real server process: a writer cannot turn the
    readers' checks off for its blocks by leaving its checksums out."""
    async with Client(quick_node.target, tenant=TENANT, timeout=5.0) as kv:
        ns = await kv.register_namespace("late-model", LAYOUT)
        lease_id, _ = await kv.lease.current()
        md = (("x-kvstore-tenant", TENANT),)
        async with grpc.aio.insecure_channel(quick_node.target) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            res = await stub.Reserve(
                pb.ReserveRequest(namespace_id=ns.id, lease_id=lease_id, tokens=TOKENS),
                metadata=md,
            )
            commit = pb.CommitRequest(
                namespace_id=ns.id, lease_id=lease_id, packed_hashes=res.hashes
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Commit(commit, metadata=md)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "packed_checksums" in (err.value.details() or "")
        assert (await kv.lookup(ns, TOKENS)).hit_blocks == 0
