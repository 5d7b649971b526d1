"""The connector's copy kernels and load path, without vLLM: CPU and GPU (fake CUDA) layouts.

vLLM's paged tensors are made here in the shapes its attention backends
use; the GPU path maps a CUDA pool through the fake runtime of the pool
tests (no GPU needed) and loads it with the connector's `WorkerSide`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvstore.client import StoreResult
from kvstore.errors import InvalidArgument
from kvstore.integrations.vllm import worker as worker_module
from kvstore.integrations.vllm.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore.integrations.vllm.paged import (
    BlockOrder,
    as_canonical,
    gather_blocks,
    paged_layer,
    scatter_blocks,
    stored_shape,
)
from kvstore.integrations.vllm.worker import LoadFailed, WorkerSide
from kvstore.layout import KVLayout
from kvstore.pool import CudaMapping, CudaPool, HostMapping, HostPool
from kvstore.types import NamespaceId, SlotId
from tests.kvstore.pool.fake_cuda import FakeCudaRuntime
from tests.waiting import wait_until

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=8, dtype="float32")
NUM_BLOCKS = 6


def cpu_layers() -> list[torch.Tensor]:
    shape = (NUM_BLOCKS, LAYOUT.num_kv_heads, LAYOUT.block_size, 2 * LAYOUT.head_dim)
    return [torch.randn(shape) for _ in range(LAYOUT.num_layers)]


def flash_layers() -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [torch.randn(shape) for _ in range(LAYOUT.num_layers)]


def cpu_kv(tensor: torch.Tensor, block: int, part: int, token: int, head: int) -> torch.Tensor:
    """What vLLM's CPU attention reads: [blocks, heads, 2 * block_size, dim], K rows first."""
    viewed = tensor.view(NUM_BLOCKS, LAYOUT.num_kv_heads, 2 * LAYOUT.block_size, LAYOUT.head_dim)
    return viewed[block, head, part * LAYOUT.block_size + token]


def test_cpu_layout_gathers_canonical_blocks() -> None:
    layers = cpu_layers()
    paged = [paged_layer(t, LAYOUT) for t in layers]
    assert {p.kind for p in paged} == {"cpu"}
    blocks = gather_blocks(paged, [4, 1], LAYOUT)
    assert blocks.shape == (2, *LAYOUT.block_shape)
    for i, block in enumerate([4, 1]):
        for layer in range(LAYOUT.num_layers):
            for part in (0, 1):
                for token in (0, 5, 7):
                    for head in (0, 1):
                        want = cpu_kv(layers[layer], block, part, token, head)
                        assert torch.equal(blocks[i, part, layer, token, head], want)


def test_flash_layout_gathers_canonical_blocks() -> None:
    layers = flash_layers()
    paged = [paged_layer(t, LAYOUT) for t in layers]
    assert {p.kind for p in paged} == {"flash"}
    blocks = gather_blocks(paged, [3], LAYOUT)
    for layer in range(LAYOUT.num_layers):
        for part in (0, 1):
            assert torch.equal(blocks[0, part, layer], layers[layer][part, 3])


@pytest.mark.parametrize("make", [cpu_layers, flash_layers])
def test_scatter_after_gather_gives_back_the_exact_bytes(make) -> None:
    source = [paged_layer(t, LAYOUT) for t in make()]
    target_tensors = [torch.zeros_like(p.tensor) for p in source]
    target = [paged_layer(t, LAYOUT) for t in target_tensors]
    blocks = gather_blocks(source, [0, 2, 5], LAYOUT)
    scatter_blocks(target, [5, 0, 3], blocks)  # other block ids, same contents
    again = gather_blocks(target, [5, 0, 3], LAYOUT)
    assert torch.equal(again, blocks)
    untouched = gather_blocks(target, [1, 2, 4], LAYOUT)
    assert not untouched.any()


@pytest.mark.parametrize("make", [cpu_layers, flash_layers])
def test_cpu_order_holds_the_same_elements_and_round_trips(make) -> None:
    source = [paged_layer(t, LAYOUT) for t in make()]
    stored = gather_blocks(source, [0, 2, 5], LAYOUT, "cpu")
    assert stored.shape == (3, *stored_shape(LAYOUT, "cpu")) and stored.is_contiguous()
    canonical = gather_blocks(source, [0, 2, 5], LAYOUT)
    assert torch.equal(as_canonical(stored, LAYOUT, "cpu"), canonical)
    # Loads read pool slots one by one, through canonical-shaped views.
    target = [paged_layer(torch.zeros_like(p.tensor), LAYOUT) for p in source]
    views = [as_canonical(row, LAYOUT, "cpu") for row in stored]
    scatter_blocks(target, [5, 0, 3], views)
    assert torch.equal(gather_blocks(target, [5, 0, 3], LAYOUT), canonical)


def test_in_cpu_order_a_block_is_the_cpu_backends_own_pages() -> None:
    layers = cpu_layers()
    stored = gather_blocks([paged_layer(t, LAYOUT) for t in layers], [4, 1], LAYOUT, "cpu")
    for i, block in enumerate([4, 1]):
        for layer in range(LAYOUT.num_layers):  # byte for byte: one contiguous copy
            assert torch.equal(stored[i, layer].reshape(-1), layers[layer][block].reshape(-1))


def test_an_unknown_backend_shape_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="not supported"):
        paged_layer(torch.zeros(NUM_BLOCKS, 8, 2, 4), LAYOUT)  # heads/tokens swapped


@dataclass
class _Namespace:
    mapping: CudaMapping | HostMapping
    epoch: int
    verify_loads: bool = False


class _Link:
    """What `WorkerSide` needs of `NodeLink`, over a mapped fake CUDA pool."""

    config = SimpleNamespace(connect_timeout=1.0, lookup_timeout=1.0, store_timeout=1.0)
    down = False
    client = None

    def __init__(self, ns: _Namespace | None) -> None:
        self.ns = ns

    def namespace(self) -> _Namespace | None:
        return self.ns

    def namespaces(self) -> tuple[_Namespace, ...] | None:
        return (self.ns,) if self.ns is not None else None

    def wait_namespaces(self, timeout: float) -> tuple[_Namespace, ...] | None:
        return self.namespaces()

    def succeeded(self) -> None:
        pass

    def failed(self, what: str, exc: BaseException) -> None:
        pass

    def close(self) -> None:
        pass


def finish(worker: WorkerSide, *requests: str) -> set[int]:
    """Wait (bounded) until the load thread reports ``requests``; their failed block ids."""
    done: set[str] = set()

    def all_finished() -> bool:
        done.update(worker.take_finished())
        return done == set(requests)

    wait_until(all_finished, within=10, interval=0.001, what=f"loads {requests} to finish")
    return worker.take_load_errors()


HELD = 1e18
"""A pins deadline far in the future (the scheduler's lease surely holds them)."""


def stamped(pool: CudaPool | HostPool, slots: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Stamp ``slots`` as the node does when their blocks commit; the stamps a lookup
    would hand the worker (generation, ident)."""
    stamps = tuple((100 + slot, 0xABC0 + slot) for slot in slots)
    for slot, (generation, ident) in zip(slots, stamps, strict=True):
        pool.stamp(SlotId(slot), generation, ident)
    return stamps


def mapped_worker(
    mapping: CudaMapping | HostMapping, order: BlockOrder = "canonical"
) -> WorkerSide:
    """A worker whose namespace (epoch 0xE1) is mapped through ``mapping``."""
    return WorkerSide(
        _Link(_Namespace(mapping, 0xE1)),  # type: ignore[arg-type]
        LAYOUT,
        [f"layer.{i}" for i in range(LAYOUT.num_layers)],
        fail_loads=False,
        max_pending_save_bytes=1 << 20,
        order=order,
    )


def test_gpu_path_loads_cuda_pool_slots_into_a_flash_cache(tmp_path) -> None:
    rt = FakeCudaRuntime(total_bytes=1 << 22)
    pool = CudaPool.create(
        NamespaceId("00112233aabbccdd"),
        LAYOUT.block_bytes,
        8,
        0xE1,
        device="cuda:0",
        runtime=rt,
        stamp_directory=str(tmp_path),
    )
    mapping = CudaMapping.open(pool.descriptor, runtime=rt)
    worker = mapped_worker(mapping)
    try:
        stored = torch.randn(2, *LAYOUT.block_shape)
        for slot, block in zip((6, 2), stored, strict=True):
            pool.write(slot, block.numpy().tobytes())
        cache = flash_layers()
        worker.register_kv_caches({f"layer.{i}": t for i, t in enumerate(cache)})
        stamps = stamped(pool, (6, 2))
        load = LoadSpec("r1", (4, 1), (6, 2), 0xE1, HELD, stamps=stamps)
        meta = KVStoreConnectorMetadata(loads=[load])
        worker.start_load(meta)
        assert finish(worker, "r1") == set()
        assert torch.equal(gather_blocks(worker.layers, [4, 1], LAYOUT), stored)
        report = worker.take_report()
        assert report is not None and report.loaded == {("r1", 0)}
        # A mapping of another epoch (the node restarted) must not be read: recompute.
        stale = KVStoreConnectorMetadata(
            loads=[LoadSpec("r2", (3,), (6,), 0xE2, HELD, stamps=stamps[:1])]
        )
        worker.start_load(stale)
        assert finish(worker, "r2") == {3}
    finally:
        worker.shutdown()
        mapping.close()
        pool.close()


@pytest.mark.parametrize("order", ["canonical", "cpu"])
def test_cpu_loads_copy_runs_of_adjacent_slots_into_adjacent_blocks(tmp_path, order) -> None:
    pool = HostPool.create(
        NamespaceId("00112233aabbccdd"), LAYOUT.block_bytes, 8, 0xE1, directory=str(tmp_path)
    )
    mapping = HostMapping.open(pool.descriptor)
    worker = mapped_worker(mapping, order)
    try:
        # Runs: slots 1-3 to blocks 0-2 (one copy per layer), slots 4-5 to blocks 4 and 3
        # (adjacent slots, blocks backwards: two), slot 7 to block 5.
        slots, block_ids = (1, 2, 3, 4, 5, 7), (0, 1, 2, 4, 3, 5)
        stored = torch.randn(len(slots), *stored_shape(LAYOUT, order))
        for slot, block in zip(slots, stored, strict=True):
            pool.write(slot, block.numpy().tobytes())
        cache = cpu_layers()
        worker.register_kv_caches({f"layer.{i}": t for i, t in enumerate(cache)})
        # An idle step (nothing scheduled) copies in start_load_kv: reported at once.
        load = LoadSpec("r", block_ids, slots, 0xE1, HELD, stamps=stamped(pool, slots))
        meta = KVStoreConnectorMetadata(loads=[load])
        meta.idle = True
        worker.start_load(meta)
        assert worker.take_finished() == {"r"} and worker.take_load_errors() == set()
        want = as_canonical(stored, LAYOUT, order)
        assert torch.equal(gather_blocks(worker.layers, block_ids, LAYOUT), want)
        # The same bytes in the pool's own order when saved back (exact round trip).
        assert torch.equal(gather_blocks(worker.layers, block_ids, LAYOUT, order), stored)
    finally:
        worker.shutdown()
        mapping.close()
        pool.close()


class _FollowingClient:
    """A client whose `follow_epoch` finds the node restarted: the namespace is mapped anew."""

    def __init__(self, mapping: HostMapping, epoch: int) -> None:
        self.mapping, self.epoch = mapping, epoch
        self.follows: list[int] = []

    def follow_epoch(self, ns: _Namespace, epoch: int, *, timeout: float | None = None) -> None:
        self.follows.append(epoch)
        ns.mapping, ns.epoch = self.mapping, self.epoch


def test_a_load_from_a_restarted_node_remaps_the_pool_before_its_copy(tmp_path) -> None:
    """A worker that only loads makes no call that meets a node restart: the scheduler's
    lookup carries the new epoch, and the worker maps the new pool before it copies."""
    old = HostPool.create(
        NamespaceId("00112233aabbccdd"), LAYOUT.block_bytes, 8, 0xE1, directory=str(tmp_path)
    )
    new = HostPool.create(
        NamespaceId("00112233aabbccdd"), LAYOUT.block_bytes, 8, 0xE2, directory=str(tmp_path)
    )
    old_mapping, new_mapping = HostMapping.open(old.descriptor), HostMapping.open(new.descriptor)
    worker = mapped_worker(old_mapping, "cpu")
    client = _FollowingClient(new_mapping, 0xE2)
    worker.link.client = client  # type: ignore[attr-defined]
    try:
        worker.register_kv_caches({f"layer.{i}": t for i, t in enumerate(cpu_layers())})
        stored = torch.randn(2, *stored_shape(LAYOUT, "cpu"))
        for slot, block in zip((3, 5), stored, strict=True):
            new.write(slot, block.numpy().tobytes())
        load = LoadSpec("r", (0, 1), (3, 5), 0xE2, HELD, stamps=stamped(new, (3, 5)))
        meta = KVStoreConnectorMetadata(loads=[load])
        meta.idle = True
        worker.start_load(meta)
        assert worker.take_finished() == {"r"} and worker.take_load_errors() == set()
        assert client.follows == [0xE2]
        want = as_canonical(stored, LAYOUT, "cpu")
        assert torch.equal(gather_blocks(worker.layers, [0, 1], LAYOUT), want)
        # A lookup of an epoch the node no longer has (it restarted again): recompute.
        client.epoch = 0xE2
        stale = KVStoreConnectorMetadata(loads=[LoadSpec("s", (2,), (3,), 0xE3, HELD)])
        stale.idle = True
        worker.start_load(stale)
        assert worker.take_finished() == {"s"} and worker.take_load_errors() == {2}
    finally:
        worker.shutdown()
        for closing in (old_mapping, new_mapping, old, new):
            closing.close()


def unreachable_worker(max_pending_save_bytes: int) -> tuple[WorkerSide, list[torch.Tensor]]:
    """A worker over CPU paged layers (registered) whose node cannot be reached."""
    cache = cpu_layers()
    names = [f"l{i}" for i in range(LAYOUT.num_layers)]
    worker = WorkerSide(
        _Link(None),  # type: ignore[arg-type]
        LAYOUT,
        names,
        fail_loads=False,
        max_pending_save_bytes=max_pending_save_bytes,
    )
    worker.register_kv_caches(dict(zip(names, cache, strict=True)))
    return worker, cache


def test_failed_or_unpinned_loads_report_their_blocks() -> None:
    worker, cache = unreachable_worker(1 << 20)
    try:
        before = [t.clone() for t in cache]
        worker.start_load(KVStoreConnectorMetadata(loads=[LoadSpec("r", (0, 1), (0, 1), 1, HELD)]))
        assert finish(worker, "r") == {0, 1}  # node unreachable
        past = time.monotonic() - 1  # the pins' deadline passed (lease lost, engine stalled)
        worker.start_load(KVStoreConnectorMetadata(loads=[LoadSpec("s", (2,), (0,), 1, past)]))
        assert finish(worker, "s") == {2}
        assert all(torch.equal(a, b) for a, b in zip(cache, before, strict=True))
        report = worker.take_report()
        assert report is not None and report.loaded == {("r", 0), ("s", 0)}
        assert report.failed_loads == {("r", 0), ("s", 0)} and report.failed_blocks == {0, 1, 2}
        # A save touching a failed load's blocks is refused until the scheduler saw it.
        worker.save(
            KVStoreConnectorMetadata(
                saves=[SaveSpec("t", (b"h" * 32,) * 3, (5, 2, 6), 0)],
                failures_seen=report.failure_seq - 1,
            )
        )
        poisoned = worker.take_report()
        assert poisoned is not None and poisoned.poisoned == {"t"}
    finally:
        worker.shutdown()


def test_a_finished_requests_blocks_are_given_back_whatever_its_last_save_does() -> None:
    worker, _ = unreachable_worker(LAYOUT.block_bytes)
    hashes = (b"h" * 32,) * 2
    # Copied out (the store then fails: no node), over the byte budget, tainted by
    # a failed load, or after shutdown: vLLM gets its blocks back each time.
    worker.save(
        KVStoreConnectorMetadata(
            saves=[
                SaveSpec("copied", hashes, (0, 1), 1, True),
                SaveSpec("theirs", hashes, (0, 1), 1, True, unit=1),  # rank 1 saves it
            ]
        )
    )
    assert worker.take_sent() == {"copied"}
    worker.save(KVStoreConnectorMetadata(saves=[SaveSpec("big", hashes, (2, 3), 0, True)]))
    worker.start_load(KVStoreConnectorMetadata(loads=[LoadSpec("l", (4,), (0,), 1, HELD)]))
    assert finish(worker, "l") == {4}
    worker.save(KVStoreConnectorMetadata(saves=[SaveSpec("tainted", hashes, (4, 5), 0, True)]))
    worker.save(KVStoreConnectorMetadata(saves=[SaveSpec("running", hashes, (2, 3), 1)]))
    sent: set[str] = set()
    # "big" goes to the save thread in parts (over the budget), which reports it sent.
    wait_until(
        lambda: sent.update(worker.take_sent()) or sent == {"big", "tainted"},
        within=10,
        interval=0.005,
        what="both finished saves to give their blocks back",
    )
    worker.shutdown()
    worker.save(KVStoreConnectorMetadata(saves=[SaveSpec("late", hashes, (0, 1), 0, True)]))
    assert worker.take_sent() == {"late"}
    assert worker.take_sent() == set()


def test_a_block_whose_stamp_moves_during_the_copy_is_a_load_error(tmp_path, monkeypatch) -> None:
    """The node hands a slot to a writer while the copy runs (its pins were dropped by a
    bookkeeping slip somewhere): the stamps read after the copy show it, and only that
    block is reported; a block moved before the copy fails the whole load unread."""
    pool = HostPool.create(
        NamespaceId("00112233aabbccdd"), LAYOUT.block_bytes, 8, 0xE1, directory=str(tmp_path)
    )
    mapping = HostMapping.open(pool.descriptor)
    worker = mapped_worker(mapping)
    real_scatter = worker_module.scatter_runs

    def scatter_then_reuse(layers, runs):  # type: ignore[no-untyped-def]
        real_scatter(layers, runs)
        pool.stamp(SlotId(3), 999, 0)  # slot 3 handed to a writer while we copied

    monkeypatch.setattr(worker_module, "scatter_runs", scatter_then_reuse)
    try:
        worker.register_kv_caches({f"layer.{i}": t for i, t in enumerate(cpu_layers())})
        slots = (1, 2, 3)
        stamps = stamped(pool, slots)
        worker.start_load(
            KVStoreConnectorMetadata(
                loads=[LoadSpec("r", (0, 1, 2), slots, 0xE1, HELD, stamps=stamps)]
            )
        )
        assert finish(worker, "r") == {2}
        stats = worker.take_stats()
        assert stats is not None
        assert stats.data["load_moved_blocks"] == 1 and stats.data["loaded_blocks"] == 2
        # Slot 3 moved before this load: nothing is copied, every block is recomputed.
        worker.start_load(
            KVStoreConnectorMetadata(
                loads=[LoadSpec("s", (4, 5), (2, 3), 0xE1, HELD, stamps=stamps[1:])]
            )
        )
        assert finish(worker, "s") == {4, 5}
    finally:
        worker.shutdown()
        mapping.close()
        pool.close()


def test_after_shutdown_a_load_fails_and_queued_loads_never_run(tmp_path) -> None:
    pool = HostPool.create(
        NamespaceId("00112233aabbccdd"), LAYOUT.block_bytes, 8, 0xE1, directory=str(tmp_path)
    )
    mapping = HostMapping.open(pool.descriptor)
    worker = mapped_worker(mapping)
    try:
        worker.register_kv_caches({f"layer.{i}": t for i, t in enumerate(cpu_layers())})
        stamps = stamped(pool, (1,))
        worker.shutdown()
        worker.start_load(
            KVStoreConnectorMetadata(
                loads=[LoadSpec("late", (0,), (1,), 0xE1, HELD, stamps=stamps)]
            )
        )
        assert finish(worker, "late") == {0}
        with pytest.raises(LoadFailed, match="shutting down"):
            worker._load(LoadSpec("direct", (0,), (1,), 0xE1, HELD, stamps=stamps))
    finally:
        mapping.close()
        pool.close()


class _StoringClient:
    """A client whose every store answers ``result`` (the node's word on each block)."""

    def __init__(self, result: StoreResult) -> None:
        self.result = result

    def store(self, ns: Any, *, hashes: list[bytes], blocks: Any, timeout: float) -> StoreResult:
        blocks(len(hashes) - 1)  # the copied-out block is asked for
        return self.result


def report_of_save(result: StoreResult) -> Any:
    """The worker's report after one save (block 0 on the node, block 1 new) the node
    answered with ``result``."""
    cache = cpu_layers()
    names = [f"l{i}" for i in range(LAYOUT.num_layers)]
    link = _Link(SimpleNamespace(mapping=None, epoch=1, verify_loads=False))  # type: ignore[arg-type]
    link.client = _StoringClient(result)  # type: ignore[assignment]
    worker = WorkerSide(
        link,  # type: ignore[arg-type]
        LAYOUT,
        names,
        fail_loads=False,
        max_pending_save_bytes=1 << 24,
    )
    try:
        worker.register_kv_caches(dict(zip(names, cache, strict=True)))
        worker.save(
            KVStoreConnectorMetadata(saves=[SaveSpec("q", (b"a" * 32, b"b" * 32), (0, 1), 1)])
        )
        report = wait_until(
            worker.take_report,
            ok=lambda report: report is not None,
            within=10,
            interval=0.005,
            what="the save to end",
        )
        return report
    finally:
        worker.shutdown()


@pytest.mark.parametrize("refused", ["no_room", "in_flight"])
def test_a_save_the_node_did_not_take_whole_is_planned_again_not_counted(refused: str) -> None:
    """A block the node had no room for (or another writer's, still in flight) is not on
    the node: the save is reported unsaved (planned again), never as saved."""
    result = StoreResult(reserved=0, hit=1, in_flight=0, no_room=0, committed=0, chain=())
    report = report_of_save(dataclasses.replace(result, **{refused: 1}))
    assert report.saved == {} and report.unsaved == {"q": False}
    whole = report_of_save(dataclasses.replace(result, reserved=1, committed=1))
    assert whole.saved == {("q", 0): 2} and whole.unsaved == {}


class _RecordingClient:
    """A client that takes every block of every store and records what it was given."""

    def __init__(self) -> None:
        self.stores: list[tuple[int, list[bytes]]] = []
        """(first new block, its blocks' bytes) of each store, in order."""

    def store(self, ns: Any, *, hashes: list[bytes], blocks: Any, timeout: float) -> StoreResult:
        first = next(i for i in range(len(hashes)) if _asks(blocks, i))
        data = [blocks(i).numpy().tobytes() for i in range(first, len(hashes))]
        self.stores.append((first, data))
        n = len(hashes) - first
        return StoreResult(reserved=n, hit=first, in_flight=0, no_room=0, committed=n, chain=())


def _asks(blocks: Any, index: int) -> bool:
    try:
        blocks(index)
    except Exception:
        return False
    return True


def test_a_save_over_the_staging_budget_is_stored_in_parts_that_fit() -> None:
    """A save of more new blocks than ``max_pending_save_bytes`` holds is never dropped
    whole: a running request's first part is staged and reported (the rest planned
    again), a finished request's is stored part by part before vLLM gets its blocks."""
    cache = cpu_layers()
    for layer in cache:
        layer.copy_(torch.randn_like(layer))
    names = [f"l{i}" for i in range(LAYOUT.num_layers)]
    link = _Link(SimpleNamespace(mapping=None, epoch=1, verify_loads=False))  # type: ignore[arg-type]
    client = _RecordingClient()
    link.client = client  # type: ignore[assignment]
    worker = WorkerSide(
        link,  # type: ignore[arg-type]
        LAYOUT,
        names,
        fail_loads=False,
        max_pending_save_bytes=2 * LAYOUT.block_bytes,  # two blocks of the five
    )
    hashes = tuple(bytes([i]) * 32 for i in range(5))
    try:
        worker.register_kv_caches(dict(zip(names, cache, strict=True)))
        worker.save(KVStoreConnectorMetadata(saves=[SaveSpec("run", hashes, (1, 2, 3, 4, 5), 0)]))
        report = wait_until(worker.take_report, ok=lambda r: r is not None, within=10)
        assert report.saved == {("run", 0): 2} and report.unsaved == {"run": False}
        worker.save(
            KVStoreConnectorMetadata(saves=[SaveSpec("done", hashes, (1, 2, 3, 4, 5), 0, True)])
        )
        assert worker.take_sent() == set()  # vLLM keeps the blocks while parts are stored
        sent: set[str] = set()
        wait_until(lambda: sent.update(worker.take_sent()) or sent == {"done"}, within=10)
        report = worker.take_report()
        assert report is not None and report.saved == {("done", 0): 5}
        firsts = [first for first, _ in client.stores[1:]]
        assert firsts == [0, 2, 4]  # three parts of at most two blocks
        stored = [block for _, part in client.stores[1:] for block in part]
        expected = gather_blocks(worker.layers, [1, 2, 3, 4, 5], LAYOUT)
        assert stored == [row.numpy().tobytes() for row in expected]
    finally:
        worker.shutdown()


LATENT = KVLayout(2, 1, 576, 16, "float32", kv_order="LATENT_LAYER_TOKEN")
"""An MLA model's layout: 2 layers of one 576-wide latent a token, 16-token blocks."""


@pytest.mark.parametrize("order", ["canonical", "cpu"])
@pytest.mark.parametrize("shape", [(6, 1, 16, 576), (6, 16, 576)], ids=["cpu", "gpu"])
def test_an_mla_latent_page_round_trips_through_blocks(shape: tuple[int, ...], order: str) -> None:
    """MLA pages (``[blocks, 1, bs, latent]`` on the CPU, ``[blocks, bs, latent]`` on GPU
    backends) hold one latent a token: a block is ``[1, layers, bs, 1, latent]``, the
    same bytes in either order, and loading what was saved gives back the exact pages."""
    pages = [torch.randn(shape) for _ in range(LATENT.num_layers)]
    layers = [paged_layer(page, LATENT) for page in pages]
    stored = gather_blocks(layers, [4, 1], LATENT, order)  # type: ignore[arg-type]
    assert stored.numel() * 4 == 2 * LATENT.block_bytes
    assert torch.equal(stored[0].flatten()[: 16 * 576], pages[0][4].flatten())
    empty = [paged_layer(torch.zeros(shape), LATENT) for _ in pages]
    scatter_blocks(empty, [2, 5], as_canonical(stored, LATENT, order))  # type: ignore[arg-type]
    for got, want in zip(empty, pages, strict=True):
        assert torch.equal(got.tensor.reshape(shape)[2], want[4])
        assert torch.equal(got.tensor.reshape(shape)[5], want[1])
    with pytest.raises(InvalidArgument, match="neither"):
        paged_layer(torch.zeros(6, 2, 16, 576), LATENT)  # two heads: not a latent page
