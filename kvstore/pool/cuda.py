"""CUDA pools: block slots in GPU memory that runners on the host open through CUDA IPC.

Design decisions (also in ``docs/cuda.md``):

* **Arenas from the runtime, not from a caching allocator.** Each arena is
  its own ``cudaMalloc``, so the ``cudaIpcGetMemHandle`` of its base covers
  exactly the arena (a handle of a pointer inside a cached block would
  export the whole cached segment, at an offset the runner cannot know).
  Handles are taken once per arena, at creation, and sent by ``AttachPool``.
  New arenas are zeroed: a slot never shows bytes of a previous allocation.
* **Devices by UUID.** The descriptor names the GPU by UUID; ordinals differ
  between processes (``CUDA_VISIBLE_DEVICES`` remaps them), UUIDs do not.
* **One open per handle per process.** The driver refuses (older CUDA) or
  reference-counts (newer) a second ``cudaIpcOpenMemHandle`` of one handle
  in a process; `_HandleCache` opens each ``(epoch, handle)`` once and closes
  it when the last mapping and the last view of it are gone. The epoch in
  the key means a restarted node's handles are never confused with old ones.
* **Views keep their arena open.** A tensor from `CudaMapping.torch_view`
  references its arena; closing the mapping while such a tensor is alive
  defers ``cudaIpcCloseMemHandle`` until the tensor is collected, so a view
  never dangles (as with host pools).
* **Ordering.** Writes into a slot must be complete before ``Commit``: the
  client's ``store`` calls `CudaMapping.synchronize` after its copies; a
  runner writing through views itself synchronises the streams it wrote on.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.errors import InvalidArgument, LimitExceeded
from kvstore.pool.base import ArenaSpec, BlockPool, PoolDescriptor, PoolMapping, PoolUnavailable
from kvstore.pool.cuda_runtime import (
    ERROR_MEMORY_ALLOCATION,
    IPC_HANDLE_BYTES,
    CudaCallFailed,
    CudaRuntime,
    default_runtime,
)
from kvstore.pool.views import torch_dtype
from kvstore.types import NamespaceId, SlotId

if TYPE_CHECKING:
    import torch

    from kvstore.layout import KVLayout

DEFAULT_ARENA_BYTES = 1 << 30
"""Arena size: few IPC handles for a large pool; one ``cudaMalloc`` each."""


# --- devices ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CudaDevice:
    """A GPU as this process sees it."""

    ordinal: int
    """Its index in this process (after ``CUDA_VISIBLE_DEVICES``)."""
    uuid: str
    """Its UUID (``GPU-...``), the same in every process."""


def parse_device(spec: str) -> str | int:
    """The UUID or ordinal a device string names.

    ``"cuda"`` is ordinal 0, ``"cuda:N"`` ordinal N, ``"cuda:GPU-..."``,
    ``"cuda:MIG-..."`` or a bare ``"GPU-..."`` a UUID.

    Raises:
        InvalidArgument: anything else (``"cpu"`` included).
    """
    text = spec.strip()
    rest = text[len("cuda:") :] if text.lower().startswith("cuda:") else text
    if text.lower() == "cuda":
        return 0
    if rest.isdigit():
        return int(rest)
    if rest.upper().startswith(("GPU-", "MIG-")) and len(rest) > 4:
        return rest
    raise InvalidArgument(f"device {spec!r} is not cuda, cuda:N, cuda:GPU-<uuid> or GPU-<uuid>")


def find_device(runtime: CudaRuntime, spec: str | int) -> CudaDevice:
    """The visible GPU a device string, ordinal or UUID names.

    Raises:
        PoolUnavailable: no such GPU is visible to this process.
        InvalidArgument: the string is malformed.
    """
    wanted = parse_device(spec) if isinstance(spec, str) else spec
    count = runtime.device_count()
    if isinstance(wanted, int):
        if not 0 <= wanted < count:
            raise PoolUnavailable(
                f"GPU ordinal {wanted} does not exist: this process sees {count} GPU(s)"
            )
        return CudaDevice(wanted, runtime.device_uuid(wanted))
    uuids = [runtime.device_uuid(i) for i in range(count)]
    for ordinal, uuid in enumerate(uuids):
        if uuid.lower() == wanted.lower():
            return CudaDevice(ordinal, uuid)
    raise PoolUnavailable(
        f"GPU {wanted} is not visible to this process (it sees {uuids or 'no GPU'}); "
        "run it on the pool's host with CUDA_VISIBLE_DEVICES including that GPU"
    )


@contextlib.contextmanager
def on_device(runtime: CudaRuntime, ordinal: int) -> Iterator[None]:
    """Make ``ordinal`` current for the calling thread, restoring the previous device."""
    previous = runtime.get_device()
    if previous != ordinal:
        runtime.set_device(ordinal)
    try:
        yield
    finally:
        if previous != ordinal:
            runtime.set_device(previous)


def current_torch_device() -> int | None:
    """The calling thread's torch CUDA device, if torch already initialised CUDA; else None.

    The client calls this before attaching in a worker thread (whose current
    device would be 0), so the runner's own GPU is what the peer check uses.
    """
    torch_module = sys.modules.get("torch")
    if torch_module is None or not torch_module.cuda.is_initialized():
        return None
    return int(torch_module.cuda.current_device())


# --- server side --------------------------------------------------------------------


class CudaPool(BlockPool):
    """A namespace's slots in GPU arenas owned by the server, exported by IPC handle."""

    def __init__(
        self,
        descriptor: PoolDescriptor,
        pointers: list[int],
        device: CudaDevice,
        runtime: CudaRuntime,
    ) -> None:
        """Wrap allocated arenas; use `create`."""
        self.descriptor = descriptor
        self.device = device
        self._pointers = pointers
        self._runtime = runtime
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def create(
        cls,
        namespace: NamespaceId,
        block_bytes: int,
        capacity: int,
        epoch: int,
        *,
        device: str | int = 0,
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        runtime: CudaRuntime | None = None,
    ) -> CudaPool:
        """Allocate, zero and export the arenas of a new pool on one GPU.

        Args:
            namespace: the namespace the pool backs.
            block_bytes: bytes of one block.
            capacity: number of slots.
            epoch: the node's pool epoch.
            device: the GPU: ordinal of this process, ``"cuda:N"`` or a UUID.
            arena_bytes: target arena size; at least one slot per arena.
            runtime: the CUDA runtime (default: cupy's).

        Raises:
            InvalidArgument: a non-positive size or a malformed device.
            LimitExceeded: the GPU has no room for the pool.
            PoolUnavailable: no cupy, no GPU, or not that GPU.
        """
        if block_bytes <= 0 or capacity <= 0 or arena_bytes <= 0:
            raise InvalidArgument(
                f"block_bytes, capacity and arena_bytes must be positive, got "
                f"{block_bytes}, {capacity}, {arena_bytes}"
            )
        runtime = runtime or default_runtime()
        gpu = find_device(runtime, device)
        slots_per_arena = max(1, arena_bytes // block_bytes)
        n_arenas = -(-capacity // slots_per_arena)
        sizes = [
            min(slots_per_arena, capacity - i * slots_per_arena) * block_bytes
            for i in range(n_arenas)
        ]
        pointers: list[int] = []
        specs: list[ArenaSpec] = []
        with on_device(runtime, gpu.ordinal):
            free, _ = runtime.mem_get_info()
            if sum(sizes) > free:
                raise LimitExceeded(
                    f"no room for a {sum(sizes)}-byte pool on GPU {gpu.uuid}: "
                    f"{free} bytes are free (lower the capacity)"
                )
            try:
                for index, size in enumerate(sizes):
                    ptr = _malloc(runtime, size, gpu)
                    pointers.append(ptr)
                    runtime.memset(ptr, 0, size)
                    handle = runtime.ipc_get_handle(ptr)
                    if len(handle) != IPC_HANDLE_BYTES:
                        raise RuntimeError(f"bug: an IPC handle of {len(handle)} bytes")
                    specs.append(ArenaSpec(index=index, size_bytes=size, cuda_ipc_handle=handle))
            except BaseException:
                for ptr in pointers:
                    with contextlib.suppress(CudaCallFailed):
                        runtime.free(ptr)
                raise
        descriptor = PoolDescriptor(
            kind="cuda",
            epoch=epoch,
            namespace=namespace,
            block_bytes=block_bytes,
            capacity=capacity,
            slots_per_arena=slots_per_arena,
            arenas=tuple(specs),
            device=gpu.uuid,
        )
        return cls(descriptor, pointers, gpu, runtime)

    def slot_pointer(self, slot: SlotId) -> int:
        """Device address of one slot (for the server's own copies)."""
        if self._closed:
            raise PoolUnavailable(f"the pool of namespace {self.descriptor.namespace} is closed")
        arena, offset = self.descriptor.locate(slot)
        return self._pointers[arena] + offset

    def view(self, slot: SlotId) -> memoryview:
        """GPU memory has no host view: use `read` and `write`.

        Raises:
            InvalidArgument: always.
        """
        raise InvalidArgument("a CUDA pool's slots are in GPU memory: use read() and write()")

    def read(self, slot: SlotId) -> bytes:
        """A host copy of one slot's bytes (device to host ``cudaMemcpy``)."""
        out = bytearray(self.descriptor.block_bytes)
        host = _host_address(out)
        with self._lock, on_device(self._runtime, self.device.ordinal):
            self._runtime.memcpy(host, self.slot_pointer(slot), len(out))
        return bytes(out)

    def write(self, slot: SlotId, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` into ``slot`` and wait for the copy, so a Commit after it is safe.

        Raises:
            InvalidArgument: wrong length or slot out of range.
        """
        source = memoryview(data).cast("B")
        if source.nbytes != self.descriptor.block_bytes:
            raise InvalidArgument(
                f"a block is {self.descriptor.block_bytes} bytes, "
                f"got {source.nbytes} for slot {slot}"
            )
        staging = bytearray(source)  # a writable, contiguous copy with a stable address
        with self._lock, on_device(self._runtime, self.device.ordinal):
            self._runtime.memcpy(self.slot_pointer(slot), _host_address(staging), len(staging))
            # A runner in another process reads this slot on its own stream once
            # it is committed: nothing orders that read after our copy but this.
            self._runtime.synchronize()

    @property
    def closed(self) -> bool:
        """True once `close` ran."""
        return self._closed

    def close(self) -> None:
        """Free the arenas; idempotent.

        Runners that still have an arena open keep the memory until they
        close it (the driver counts the opens); they notice the restart by
        the epoch and never read it again.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pointers, self._pointers = self._pointers, []
        with on_device(self._runtime, self.device.ordinal):
            for ptr in pointers:
                self._runtime.free(ptr)


def _malloc(runtime: CudaRuntime, size: int, gpu: CudaDevice) -> int:
    try:
        return runtime.malloc(size)
    except CudaCallFailed as exc:
        if exc.code == ERROR_MEMORY_ALLOCATION:
            raise LimitExceeded(
                f"GPU {gpu.uuid} is out of memory allocating a {size}-byte arena"
            ) from exc
        raise


def _host_address(buffer: bytearray) -> int:
    """Address of a bytearray's bytes (valid while it is neither resized nor freed)."""
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))


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
    ) -> None:
        """Wrap opened arenas; use `open` (or `kvstore.pool.attach`)."""
        self.descriptor = descriptor
        self.device = device
        """The pool's GPU, where the slots live (and what their tensors say)."""
        self.runner_device = runner_device
        """The GPU this runner computes on; peer access to `device` when they differ."""
        self._arenas = arenas
        self._runtime = runtime
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
        except BaseException:
            arenas.clear()  # finalizers release what was opened
            raise
        return cls(descriptor, arenas, pool_gpu, runner_gpu, runtime)

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
        """Wait until copies into the slots issued by this thread are complete.

        Synchronises torch's current stream on the pool's GPU and on the
        runner's GPU (a cross-device copy runs on one of them), or the whole
        device when torch has not initialised CUDA. Call before ``Commit``.
        """
        torch_module = sys.modules.get("torch")
        if torch_module is not None and torch_module.cuda.is_initialized():
            for ordinal in {self.device.ordinal, self.runner_device.ordinal}:
                torch_module.cuda.current_stream(ordinal).synchronize()
            return
        with on_device(self._runtime, self.device.ordinal):
            self._runtime.synchronize()

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
