"""CUDA pools, runner side: each arena opened once per process through CUDA IPC.

The server side (`CudaPool`) and the devices live in `kvstore.pool.cuda`;
``docs/cuda.md`` and that module's docstring give the design. This module
holds what a runner process keeps:

* **One open per handle per process.** The driver refuses (older CUDA) or
  reference-counts (newer) a second ``cudaIpcOpenMemHandle`` of one handle
  in a process; `_HandleCache` opens each ``(epoch, handle)`` once and closes
  it when the last mapping and the last view of it are gone.
* **Views keep their arena open.** A tensor from `CudaMapping.torch_view`
  references its arena, so closing the mapping while such a tensor is alive
  defers ``cudaIpcCloseMemHandle`` until the tensor is collected.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.errors import InvalidArgument
from kvstore.pool.base import ArenaSpec, PoolDescriptor, PoolMapping, PoolUnavailable
from kvstore.pool.cuda import CudaDevice, find_device, on_device
from kvstore.pool.cuda_caller import caller_streams
from kvstore.pool.cuda_runtime import IPC_HANDLE_BYTES, CudaCallFailed, CudaRuntime, default_runtime
from kvstore.pool.stamps import StampReader
from kvstore.pool.views import torch_dtype
from kvstore.types import SlotId

if TYPE_CHECKING:
    import torch

    from kvstore.layout import KVLayout


# --- runner side: the per-process handle cache --------------------------------------

_HandleKey = tuple[int, bytes]
"""(pool epoch, IPC handle): a restarted node's handles never match old entries."""


@dataclass(slots=True, eq=False)
class _OpenHandle:
    """One ``cudaIpcOpenMemHandle`` in this process, shared by every user of the handle."""

    key: _HandleKey
    pointer: int
    device: int
    runtime: CudaRuntime
    users: int = 0


@dataclass(slots=True, eq=False)
class _HandleCache:
    """Opens each IPC handle once per process and closes it when its last user is gone."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    """Re-entrant: a view's finalizer may run (garbage collection) while it is held."""
    entries: dict[_HandleKey, _OpenHandle] = field(default_factory=dict)

    def acquire(self, key: _HandleKey, device: int, runtime: CudaRuntime) -> _OpenHandle:
        with self.lock:
            entry = self.entries.get(key)
            if entry is None:
                with on_device(runtime, device):
                    pointer = runtime.ipc_open(key[1])
                entry = _OpenHandle(key, pointer, device, runtime)
                self.entries[key] = entry
            entry.users += 1
            return entry

    def release(self, entry: _OpenHandle) -> None:
        with self.lock:
            entry.users -= 1
            if entry.users > 0:
                return
            if entry.users < 0:
                raise RuntimeError("bug: an IPC handle released more often than acquired")
            del self.entries[entry.key]
            with on_device(entry.runtime, entry.device):
                entry.runtime.ipc_close(entry.pointer)

    def open_count(self) -> int:
        """Handles open in this process now."""
        with self.lock:
            return len(self.entries)


_CACHE = _HandleCache()


def open_handles() -> int:
    """How many IPC handles this process has open (for tests and metrics)."""
    return _CACHE.open_count()


class _ArenaRef:
    """A mapping's (or a view's) hold on one open arena; the last one gone closes it.

    Tensors made by `CudaMapping.torch_view` own a reference (through the
    DLPack owner), so the handle stays open while a view is alive.
    """

    __slots__ = ("__weakref__", "entry", "size")

    def __init__(self, entry: _OpenHandle, size: int) -> None:
        self.entry = entry
        self.size = size
        weakref.finalize(self, _CACHE.release, entry)


class CudaMapping(PoolMapping):
    """A CUDA pool's arenas opened in a runner process; slots as GPU tensors."""

    def __init__(
        self,
        descriptor: PoolDescriptor,
        arenas: list[_ArenaRef],
        device: CudaDevice,
        runner_device: CudaDevice,
        runtime: CudaRuntime,
        stamps: StampReader | None = None,
    ) -> None:
        """Wrap opened arenas (and stamp files); use `open` (or `kvstore.pool.attach`)."""
        self.descriptor = descriptor
        self.device = device
        """The pool's GPU, where the slots live (and what their tensors say)."""
        self.runner_device = runner_device
        """The GPU this runner computes on; peer access to `device` when they differ."""
        self._arenas = arenas
        self._runtime = runtime
        self._stamp_maps = stamps
        self._closed = False

    @classmethod
    def open(
        cls,
        descriptor: PoolDescriptor,
        *,
        device: str | int | None = None,
        runtime: CudaRuntime | None = None,
    ) -> CudaMapping:
        """Open every arena of a CUDA pool in this process (once per handle).

        Args:
            descriptor: what ``AttachPool`` returned (``kind == "cuda"``).
            device: the runner's GPU (ordinal, ``"cuda:N"`` or UUID); None
                means the pool's own GPU.
            runtime: the CUDA runtime (default: cupy's).

        Raises:
            PoolUnavailable: no cupy or GPU here, the pool's GPU is not
                visible, the runner's GPU cannot reach it peer-to-peer, or a
                handle no longer opens (the node restarted: attach again).
            InvalidArgument: not a CUDA descriptor, or a malformed handle.
        """
        if descriptor.kind != "cuda":
            raise InvalidArgument(f"CudaMapping maps CUDA pools, got kind {descriptor.kind!r}")
        runtime = runtime or default_runtime()  # first: no cupy is the clearest error
        for spec in descriptor.arenas:
            if len(spec.cuda_ipc_handle) != IPC_HANDLE_BYTES:
                raise InvalidArgument(
                    f"arena {spec.index} has a {len(spec.cuda_ipc_handle)}-byte IPC handle, "
                    f"expected {IPC_HANDLE_BYTES}"
                )
        pool_gpu = find_device(runtime, descriptor.device)
        runner_gpu = pool_gpu if device is None else find_device(runtime, device)
        if runner_gpu.ordinal != pool_gpu.ordinal:
            _enable_peer(runtime, runner_gpu, pool_gpu)
        arenas: list[_ArenaRef] = []
        try:
            for spec in descriptor.arenas:
                entry = _open(runtime, descriptor, spec, pool_gpu)
                arenas.append(_ArenaRef(entry, spec.size_bytes))
            stamps = StampReader.open(descriptor)  # host shared memory: no GPU sync to read
        except BaseException:
            arenas.clear()  # finalizers release what was opened
            raise
        return cls(descriptor, arenas, pool_gpu, runner_gpu, runtime, stamps)

    def buffer(self, slot: SlotId) -> memoryview:
        """GPU memory has no host buffer: use `torch_view`.

        Raises:
            InvalidArgument: always.
        """
        raise InvalidArgument(
            "a CUDA pool's slots are in GPU memory: use torch_view() (Hit.torch_views()), "
            "or read them over gRPC with Client.read_blocks"
        )

    def slot_tensor(self, slot: SlotId) -> torch.Tensor:
        """Zero-copy flat ``uint8`` tensor of one slot, on the pool's GPU."""
        arena_ref = self._arena(slot)
        _, offset = self.descriptor.locate(slot)
        return self._runtime.as_tensor(
            arena_ref.entry.pointer + offset,
            self.descriptor.block_bytes,
            self.device.ordinal,
            arena_ref,
        )

    def torch_view(self, slot: SlotId, layout: KVLayout) -> torch.Tensor:
        """Zero-copy tensor of one slot on the pool's GPU, with the layout's dtype and shape.

        bfloat16 and float8 work too: the memory is handed over as bytes and
        viewed with the torch dtype (cupy has neither).
        """
        self._check_layout(layout)
        return self.slot_tensor(slot).view(torch_dtype(layout.dtype)).view(layout.block_shape)

    def synchronize(self) -> None:
        """Wait until copies into the slots issued by the caller are complete.

        Synchronises torch's current stream on the pool's GPU and on the
        runner's GPU (a cross-device copy runs on one of them), the caller's
        streams when a `kvstore.pool.cuda_caller` state was captured, or the
        whole device when torch has not initialised CUDA. Call before ``Commit``.
        """
        streams = self._current_streams()
        if streams is not None:
            for stream in streams:
                stream.synchronize()
            return
        with on_device(self._runtime, self.device.ordinal):
            self._runtime.synchronize()

    def read_fence(self, streams: Sequence[Any] | None = None) -> Callable[[], None] | None:
        """Record the end of the reads queued so far; the returned callable waits for them.

        Args:
            streams: the streams (``torch.cuda.Stream``) the caller read the
                slots on, or events (``torch.cuda.Event``) it recorded after
                its reads. None: the caller's current streams on the pool's GPU
                and the runner's GPU; without torch CUDA, the whole pool GPU
                and runner GPU (reads by cupy or other libraries). An empty
                sequence: nothing to wait for (the caller synchronised).

        The events are recorded here, in the calling thread; the wait may run
        in any thread (the async client runs it in a worker thread).
        """
        if streams is None:
            streams = self._current_streams()
        if streams is None:
            runtime = self._runtime
            ordinals = sorted({self.device.ordinal, self.runner_device.ordinal})

            def wait_devices() -> None:
                for ordinal in ordinals:
                    with on_device(runtime, ordinal):
                        runtime.synchronize()

            return wait_devices
        events = [s.record_event() if hasattr(s, "record_event") else s for s in streams]
        if not events:
            return None

        def wait_events() -> None:
            for event in events:
                event.synchronize()

        return wait_events

    def _current_streams(self) -> list[Any] | None:
        """The caller's current torch streams on the pool's and the runner's GPU, or None.

        None when torch has not initialised CUDA (nothing queued through torch).
        """
        torch_module = sys.modules.get("torch")
        if torch_module is None or not torch_module.cuda.is_initialized():
            return None
        ordinals = sorted({self.device.ordinal, self.runner_device.ordinal})
        with caller_streams():
            return [torch_module.cuda.current_stream(o) for o in ordinals]

    def _arena(self, slot: SlotId) -> _ArenaRef:
        if self._closed:
            raise PoolUnavailable(
                f"the mapping of namespace {self.descriptor.namespace} "
                f"(epoch {self.descriptor.epoch:x}) is closed"
            )
        arena, _ = self.descriptor.locate(slot)
        return self._arenas[arena]

    @property
    def closed(self) -> bool:
        """True once `close` ran."""
        return self._closed

    def close(self) -> None:
        """Drop this mapping's hold on its arenas; views still alive keep theirs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._arenas = []  # each _ArenaRef's finalizer releases its handle
        if self._stamp_maps is not None:
            self._stamp_maps.close()
            self._stamp_maps = None

    def _stamp_reader(self) -> StampReader | None:
        return self._stamp_maps


def _enable_peer(runtime: CudaRuntime, runner: CudaDevice, pool: CudaDevice) -> None:
    if not runtime.can_access_peer(runner.ordinal, pool.ordinal):
        raise PoolUnavailable(
            f"the pool is on GPU {pool.uuid} and this runner computes on GPU {runner.uuid}, "
            "which cannot access it peer-to-peer: run the runner on the pool's GPU, attach "
            "the node that serves this GPU, or read over gRPC (Client(map_pool=False))"
        )
    with on_device(runtime, runner.ordinal):
        runtime.enable_peer(pool.ordinal)


def _open(
    runtime: CudaRuntime, descriptor: PoolDescriptor, spec: ArenaSpec, gpu: CudaDevice
) -> _OpenHandle:
    try:
        return _CACHE.acquire((descriptor.epoch, spec.cuda_ipc_handle), gpu.ordinal, runtime)
    except CudaCallFailed as exc:
        raise PoolUnavailable(
            f"cannot open arena {spec.index} of namespace {descriptor.namespace} "
            f"(epoch {descriptor.epoch:x}): {exc}. The node restarted or dropped the "
            "namespace; attach the pool again"
        ) from exc
