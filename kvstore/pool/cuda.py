"""CUDA pools: block slots in GPU memory that runners on the host open through CUDA IPC.

This module holds the devices and the server side (`CudaPool`); the runner
side (`CudaMapping` and the per-process IPC handle cache) is in
`kvstore.pool.cuda_mapping`. Design decisions (also in ``docs/cuda.md``):

* **Arenas from the runtime, not from a caching allocator.** Each arena is
  its own ``cudaMalloc``, so the ``cudaIpcGetMemHandle`` of its base covers
  exactly the arena (a handle of a pointer inside a cached block would
  export the whole cached segment, at an offset the runner cannot know).
  Handles are taken once per arena, at creation, and sent by ``AttachPool``.
  New arenas are zeroed: a slot never shows bytes of a previous allocation.
* **One namespace per allocation, 2 MiB multiples.** An IPC handle exposes
  the whole 2 MiB block its allocation lies in, so every arena is its own
  allocation of a multiple of 2 MiB (padded; the padding stays zero and
  holds no slot) at a 2 MiB-aligned address: a runner that opens one
  namespace's handles can never reach another namespace's memory.
* **Devices by UUID.** The descriptor names the GPU by UUID; ordinals differ
  between processes (``CUDA_VISIBLE_DEVICES`` remaps them), UUIDs do not.
* **One open per handle per process.** The driver refuses (older CUDA) or
  reference-counts (newer) a second ``cudaIpcOpenMemHandle`` of one handle
  in a process; `kvstore.pool.cuda_mapping` opens each ``(epoch, handle)`` once and closes
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
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.checksum import block_checksum
from kvstore.errors import InvalidArgument, LimitExceeded
from kvstore.pool.base import (
    ArenaSpec,
    BlockPool,
    PoolDescriptor,
    PoolUnavailable,
    block_destination,
    plan_arenas,
)
from kvstore.pool.cuda_runtime import (
    ERROR_MEMORY_ALLOCATION,
    IPC_HANDLE_BYTES,
    CudaCallFailed,
    CudaRuntime,
    default_runtime,
)
from kvstore.pool.host import arena_file_name
from kvstore.pool.stamps import StampFile, StampTable, stamp_file_name
from kvstore.types import NamespaceId, SlotId

DEFAULT_ARENA_BYTES = 1 << 30
"""Arena size: few IPC handles for a large pool; one ``cudaMalloc`` each."""

IPC_GRANULARITY = 2 << 20
"""CUDA IPC shares whole 2 MiB-aligned blocks: arenas are sized (and aligned) to it."""


def ipc_size(nbytes: int) -> int:
    """``nbytes`` rounded up to the IPC granularity (the allocation size of an arena).

    ``cudaMalloc`` may carve a smaller allocation out of a 2 MiB block shared
    with other allocations, and ``cudaIpcGetMemHandle`` then exports the
    whole block (CUDA programming guide, "Interprocess Communication"): a
    runner of one namespace could reach another namespace's arena, or the
    node's own memory. An allocation of a 2 MiB multiple has a block of its
    own, so a handle exposes exactly its arena.
    """
    return -(-nbytes // IPC_GRANULARITY) * IPC_GRANULARITY


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


# --- server side --------------------------------------------------------------------


class CudaPool(BlockPool):
    """A namespace's slots in GPU arenas owned by the server, exported by IPC handle."""

    def __init__(
        self,
        descriptor: PoolDescriptor,
        pointers: list[int],
        device: CudaDevice,
        runtime: CudaRuntime,
        stamp_table: StampTable | None = None,
    ) -> None:
        """Wrap allocated arenas (and their stamp files); use `create`."""
        self.descriptor = descriptor
        self.stamp_table = stamp_table
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
        stamp_directory: str | None = None,
        prefix: str = "kvstore",
        mode: int = 0o600,
        group: int | None = None,
        first_index: int = 0,
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
            stamp_directory: where the arenas' stamp files go, in host shared
                memory (the node's host pool directory); None: no stamp table.
            prefix, mode, group, first_index: the stamp files' name prefix,
                mode, group and first number, as `HostPool.create` names arenas.

        Raises:
            InvalidArgument: a non-positive size or a malformed device.
            LimitExceeded: the GPU has no room for the pool.
            PoolUnavailable: no cupy, no GPU, or not that GPU.
        """
        slots_per_arena, arena_slots = plan_arenas(block_bytes, capacity, arena_bytes)
        runtime = runtime or default_runtime()
        gpu = find_device(runtime, device)
        sizes = [ipc_size(slots * block_bytes) for slots in arena_slots]
        pointers: list[int] = []
        specs: list[ArenaSpec] = []
        stamps: list[StampFile] = []
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
                    if ptr % IPC_GRANULARITY:
                        raise PoolUnavailable(
                            f"cudaMalloc of {size} bytes on GPU {gpu.uuid} returned {ptr:#x}, "
                            f"not aligned to {IPC_GRANULARITY >> 20} MiB: its IPC handle could "
                            "expose memory next to it, so the pool is not created"
                        )
                    runtime.memset(ptr, 0, size)
                    handle = runtime.ipc_get_handle(ptr)
                    if len(handle) != IPC_HANDLE_BYTES:
                        raise RuntimeError(f"bug: an IPC handle of {len(handle)} bytes")
                    stamp_path = ""
                    if stamp_directory is not None:
                        number = first_index + index
                        name = arena_file_name(prefix, os.getpid(), epoch, namespace, number)
                        stamp_path = os.path.join(stamp_directory, stamp_file_name(name))
                        stamps.append(
                            StampFile.create(stamp_path, arena_slots[index], mode=mode, group=group)
                        )
                    specs.append(
                        ArenaSpec(index, size, cuda_ipc_handle=handle, stamp_path=stamp_path)
                    )
            except BaseException:
                for ptr in pointers:
                    with contextlib.suppress(CudaCallFailed):
                        runtime.free(ptr)
                StampTable(stamps, slots_per_arena).close()
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
        table = StampTable(stamps, slots_per_arena) if stamp_directory is not None else None
        return cls(descriptor, pointers, gpu, runtime, table)

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

    def checksum(self, slot: SlotId) -> int:
        """The checksum of a host copy of one slot's bytes (no kernel on the device yet)."""
        return block_checksum(self.read(slot))

    def read(self, slot: SlotId) -> bytes:
        """A host copy of one slot's bytes (device to host ``cudaMemcpy``)."""
        out = bytearray(self.descriptor.block_bytes)
        self.read_into(slot, memoryview(out))
        return bytes(out)

    def read_into(self, slot: SlotId, dest: memoryview) -> None:
        """Copy one slot's bytes straight into ``dest`` (device to host ``cudaMemcpy``; a
        writable host buffer, ``block_bytes`` long, e.g. the disk tier's write buffer).

        Raises:
            InvalidArgument: ``dest`` is not ``block_bytes`` long.
            PoolUnavailable: the pool is closed.
        """
        out = block_destination(dest, self.descriptor.block_bytes, slot)
        with self._lock, on_device(self._runtime, self.device.ordinal):
            self._runtime.memcpy(_host_address(out), self.slot_pointer(slot), out.nbytes)

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
        if self.stamp_table is not None:
            self.stamp_table.close()
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


def _host_address(buffer: bytearray | memoryview) -> int:
    """Address of a writable buffer's bytes (valid while it is neither resized nor freed)."""
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
