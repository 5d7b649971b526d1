"""CUDA pools on a real GPU: a server process and runner processes sharing blocks by IPC.

Skipped without cupy or a GPU (see conftest). Each test starts ``python -m
service --device cuda:0`` and runners from ``tests/gpu/_runner.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.errors import FailedPrecondition
from kvstore.pool import ArenaSpec, PoolDescriptor, PoolUnavailable, attach
from kvstore.types import NamespaceId
from tests.gpu.node import Node

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[2]


def run_runner(mode: str, address: str, seed: int = 1, timeout: float = 120) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu._runner", mode, address, str(seed)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_one_process_stores_another_reads_byte_exact(node: Node) -> None:
    stored = run_runner("store", node.address, seed=11)
    assert stored["committed"] == 8
    read = run_runner("read", node.address, seed=11)
    assert read == {"hit_blocks": 8, "exact": True, "device": "cuda:0"}


def test_a_dropped_arena_is_kept_while_a_runner_maps_it(node: Node) -> None:
    """DropNamespace while a runner has the pool's arena open (cudaIpcOpenMemHandle):
    the node keeps the memory (cudaFree of an exported allocation that is still
    imported is undefined), so a new pool's cudaMalloc cannot get it, until the
    runner lets go (its lease ends when it closes)."""
    import grpc

    from kvstore.v1 import kvstore_pb2 as pb
    from kvstore.v1 import kvstore_pb2_grpc

    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.gpu._runner", "hold", node.address, "21"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert holder.stdin is not None and holder.stdout is not None
    try:
        ready = json.loads(holder.stdout.readline())
        assert ready["hit_blocks"] == 8, ready
        with grpc.insecure_channel(node.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            stub.DropNamespace(
                pb.DropNamespaceRequest(namespace_id=ready["namespace_id"], force=True), timeout=30
            )
            held = stub.Stats(pb.StatsRequest(), timeout=30).allocated_bytes
            assert held > 0  # the dropped pool's arena is still allocated
            # A new pool of the same model: fresh cudaMalloc, other bytes.
            assert run_runner("store", node.address, seed=22)["committed"] == 8
            during = stub.Stats(pb.StatsRequest(), timeout=30).allocated_bytes
            holder.stdin.write("go\n")
            holder.stdin.flush()
            out, err = holder.communicate(timeout=120)
            assert holder.returncode == 0, err
            assert json.loads(out.strip().splitlines()[-1]) == {"exact_after_drop": True}
            # The holder closed its client (unmapped, then ended its lease): freed now.
            after = stub.Stats(pb.StatsRequest(), timeout=30).allocated_bytes
            assert after == during - held, (held, during, after)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_killed_runner_does_not_corrupt_the_pool(node: Node) -> None:
    assert run_runner("store", node.address, seed=21)["committed"] == 8
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.gpu._runner", "hang", node.address, "21"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert json.loads(line) == {"pinned": 8, "writing": True}, proc.stderr.read()
    finally:
        proc.kill()  # SIGKILL with the pool mapped, 8 pins and reserved, half-written slots
        proc.wait()
    assert node.proc.poll() is None, "the node died with its runner"
    assert run_runner("read", node.address, seed=21)["exact"] is True
    time.sleep(3)  # the dead runner's lease (TTL 2 s) expires: its reservations are aborted
    assert run_runner("store", node.address, seed=22)["committed"] == 8
    assert run_runner("read", node.address, seed=22)["exact"] is True


def test_restarted_server_invalidates_old_handles(tmp_path: Path) -> None:
    first = Node(tmp_path)
    try:
        old = run_runner("descriptor", first.address)
    finally:
        first.stop()
    second = Node(tmp_path)
    try:
        new = run_runner("descriptor", second.address)
        assert new["epoch"] != old["epoch"]
        assert new["device"] == old["device"]
        descriptor = PoolDescriptor(
            kind="cuda",
            epoch=old["epoch"],
            namespace=NamespaceId("0" * 16),
            block_bytes=1,
            capacity=len(old["handles"]),
            slots_per_arena=1,
            arenas=tuple(
                ArenaSpec(index=i, size_bytes=1, cuda_ipc_handle=bytes.fromhex(h))
                for i, h in enumerate(old["handles"])
            ),
            device=old["device"],
        )
        # The memory behind the old handles was freed with the old process.
        with pytest.raises(PoolUnavailable, match="attach the pool again"):
            attach(descriptor)
        # ... while fresh runners attach the new pool and work.
        assert run_runner("store", second.address, seed=31)["committed"] == 8
        assert run_runner("read", second.address, seed=31)["exact"] is True
    finally:
        second.stop()


def test_pool_gpu_not_visible_is_a_clear_error(node: Node) -> None:
    d = run_runner("descriptor", node.address)
    descriptor = PoolDescriptor(
        kind="cuda", epoch=d["epoch"], namespace=NamespaceId("0" * 16), block_bytes=1,
        capacity=1, slots_per_arena=1,
        arenas=(ArenaSpec(index=0, size_bytes=1, cuda_ipc_handle=bytes.fromhex(d["handles"][0])),),
        device="GPU-00000000-0000-0000-0000-000000000000",
    )  # fmt: skip
    with pytest.raises(FailedPrecondition, match="not visible"):
        attach(descriptor)
