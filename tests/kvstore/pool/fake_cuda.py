"""A fake `CudaRuntime` over host memory, for testing the CUDA pool without a GPU.

"Device memory" is numpy arrays; IPC handles are 64-byte tokens in a
registry. The fake keeps the driver's rules that the pool depends on:

* a handle opens only while its allocation is alive (a freed arena, i.e. a
  restarted node, fails to open, as ``cudaErrorInvalidResourceHandle``);
* a handle already open in the process may not be opened again (the
  older drivers' rule; the pool must cache its opens);
* closing a pointer that is not open is an error;
* freeing an allocation that an importer still has open (``cudaFree`` in the
  exporter before ``cudaIpcCloseMemHandle`` in the importer, which CUDA
  leaves undefined) is an error (`FREED_WHILE_IMPORTED`): the node must keep
  an arena until no runner maps it;
* small allocations share memory: as the real allocator may, a ``malloc``
  whose size is not a multiple of 2 MiB is carved from a 2 MiB block shared
  with other small allocations, and an IPC handle exports the whole block
  (`reachable`). Allocations of whole 2 MiB multiples get blocks of their own,
  aligned to 2 MiB.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.pool.cuda_runtime import ERROR_MEMORY_ALLOCATION, CudaCallFailed

FREED_WHILE_IMPORTED = 999
"""Not a CUDA code: the fake's error for freeing memory an importer still has open."""
INVALID_HANDLE = 400
INVALID_VALUE = 1
GRANULARITY = 2 << 20
"""The unit CUDA IPC shares memory in."""


@dataclass
class _Block:
    """A piece of "device memory" that allocations are carved from."""

    array: np.ndarray
    base: int
    device: int
    used: int = 0
    """Bytes handed out (small allocations bump this)."""
    users: int = 0
    """Live allocations in it."""


@dataclass
class FakeCudaRuntime:
    uuids: list[str] = field(default_factory=lambda: ["GPU-00000000-0000-0000-0000-000000000000"])
    peer: set[tuple[int, int]] = field(default_factory=set)
    """(device, peer) pairs that may access each other."""
    total_bytes: int = 64 << 20
    current: int = 0
    allocations: dict[int, tuple[np.ndarray, int]] = field(default_factory=dict)
    """Base pointer -> (its bytes, device)."""
    blocks: dict[int, _Block] = field(default_factory=dict)
    """Block base -> block; each allocation lies in one."""
    handles: dict[bytes, int] = field(default_factory=dict)
    opened: dict[int, bytes] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    peers_enabled: set[tuple[int, int]] = field(default_factory=set)
    graveyard: list[np.ndarray] = field(default_factory=list)
    _serial: itertools.count = field(default_factory=lambda: itertools.count(1))
    _exiting: bool = False

    # --- devices
    def device_count(self) -> int:
        return len(self.uuids)

    def device_uuid(self, device: int) -> str:
        self._check_device(device)
        return self.uuids[device]

    def get_device(self) -> int:
        return self.current

    def set_device(self, device: int) -> None:
        self._check_device(device)
        self.current = device

    def mem_get_info(self) -> tuple[int, int]:
        used = sum(b.array.nbytes for b in self.blocks.values() if b.device == self.current)
        return self.total_bytes - used, self.total_bytes

    # --- memory
    def malloc(self, nbytes: int) -> int:
        self.calls.append("malloc")
        size = -(-nbytes // 256) * 256
        block = None
        if nbytes % GRANULARITY:  # small: share a block with other small allocations
            block = next(
                (
                    b
                    for b in self.blocks.values()
                    if b.device == self.current and b.used > 0 and b.used + size <= GRANULARITY
                ),
                None,
            )
        if block is None:
            block = self._new_block(max(GRANULARITY, -(-nbytes // GRANULARITY) * GRANULARITY))
        offset = block.used
        block.used += size
        block.users += 1
        array = block.array[offset : offset + nbytes]
        ptr = block.base + offset
        self.allocations[ptr] = (array, self.current)
        return ptr

    def _new_block(self, size: int) -> _Block:
        if size > self.mem_get_info()[0]:
            raise CudaCallFailed("malloc", ERROR_MEMORY_ALLOCATION, "out of memory")
        raw = np.full(size + GRANULARITY, 0xAB, dtype=np.uint8)  # not zeroed, like cudaMalloc
        skip = -raw.ctypes.data % GRANULARITY
        array = raw[skip : skip + size]
        block = _Block(array, array.ctypes.data, self.current)
        self.blocks[block.base] = block
        return block

    def _block_of(self, ptr: int) -> _Block:
        for block in self.blocks.values():
            if block.base <= ptr < block.base + block.array.nbytes:
                return block
        raise KeyError(ptr)

    @contextlib.contextmanager
    def exporter_exiting(self) -> Iterator[None]:
        """Frees made meanwhile are the exporting process exiting (a node restart): the
        driver reclaims its memory whatever importers hold, which is not an error."""
        self._exiting = True
        try:
            yield
        finally:
            self._exiting = False

    def free(self, ptr: int) -> None:
        self.calls.append("free")
        if ptr in self.opened and not self._exiting:
            raise CudaCallFailed(
                "free", FREED_WHILE_IMPORTED, "freed while an importer still has it open"
            )
        self.allocations.pop(ptr)
        block = self._block_of(ptr)
        block.users -= 1
        if block.users == 0:
            del self.blocks[block.base]
            self.graveyard.append(block.array)  # keep the bytes: a stray view must not crash
        for handle, base in list(self.handles.items()):
            if base == ptr:
                del self.handles[handle]

    def reachable(self, handle: bytes) -> tuple[int, int]:
        """``(start, size)`` of the memory a process that opens ``handle`` can reach.

        The whole block holding the exported allocation: other allocations
        carved from the same block are exposed with it.
        """
        block = self._block_of(self.handles[handle])
        return block.base, block.array.nbytes

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        ctypes.memset(ptr, value, nbytes)

    def memcpy(self, dst: int, src: int, nbytes: int) -> None:
        self.calls.append("memcpy")
        ctypes.memmove(dst, src, nbytes)

    def synchronize(self) -> None:
        self.calls.append(f"synchronize:{self.current}")

    # --- IPC
    def ipc_get_handle(self, ptr: int) -> bytes:
        self.calls.append("ipc_get_handle")
        if ptr not in self.allocations:
            raise CudaCallFailed("ipcGetMemHandle", INVALID_VALUE, "not an allocation base")
        handle = f"fake-ipc-{next(self._serial)}".encode().ljust(64, b"\0")
        self.handles[handle] = ptr
        return handle

    def ipc_open(self, handle: bytes) -> int:
        self.calls.append("ipc_open")
        ptr = self.handles.get(handle)
        if ptr is None:
            raise CudaCallFailed("ipcOpenMemHandle", INVALID_HANDLE, "invalid resource handle")
        if ptr in self.opened:
            raise CudaCallFailed("ipcOpenMemHandle", INVALID_VALUE, "handle already open")
        self.opened[ptr] = handle
        return ptr

    def ipc_close(self, ptr: int) -> None:
        self.calls.append("ipc_close")
        if ptr not in self.opened:
            raise CudaCallFailed("ipcCloseMemHandle", INVALID_VALUE, "not open")
        del self.opened[ptr]

    def can_access_peer(self, device: int, peer: int) -> bool:
        return (device, peer) in self.peer

    def enable_peer(self, peer: int) -> None:
        self.peers_enabled.add((self.current, peer))

    def as_tensor(self, ptr: int, nbytes: int, device: int, owner: object) -> torch.Tensor:
        buffer = (ctypes.c_uint8 * nbytes).from_address(ptr)
        buffer._owner = owner  # type: ignore[attr-defined]  # the tensor keeps it alive
        return torch.frombuffer(buffer, dtype=torch.uint8)

    # --- helpers for tests
    def open_count(self) -> int:
        return len(self.opened)

    def _check_device(self, device: int) -> None:
        if not 0 <= device < len(self.uuids):
            raise CudaCallFailed("setDevice", 101, "invalid device ordinal")


# --- torch.cuda as a runner on a GPU sees it ------------------------------------------


class FakeEvent:
    """A ``torch.cuda.Event`` recorded on a `FakeStream`; its waits are logged."""

    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream

    def synchronize(self) -> None:
        self.stream.log.append(f"wait:{self.stream.name}:{threading.current_thread().name}")


class FakeStream:
    """A ``torch.cuda.Stream``: records events and synchronises into a shared log."""

    def __init__(self, name: str, device: int, log: list[str]) -> None:
        self.name = name
        self.device = device
        self.log = log

    def record_event(self) -> FakeEvent:
        self.log.append(f"record:{self.name}:{threading.current_thread().name}")
        return FakeEvent(self)

    def synchronize(self) -> None:
        self.log.append(f"sync:{self.name}")


class FakeTorchCuda:
    """``torch.cuda``'s per-thread current device and streams, on CPU-only torch.

    Every thread starts on device 0 with a default stream per device, as in
    torch; `install` patches ``torch.cuda`` for one test.
    """

    def __init__(self) -> None:
        self.log: list[str] = []
        self._local = threading.local()
        self._defaults: dict[int, FakeStream] = {}

    def install(self, monkeypatch) -> None:  # type: ignore[no-untyped-def]
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "current_device", self.current_device)
        monkeypatch.setattr(cuda, "set_device", self.set_device)
        monkeypatch.setattr(cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(cuda, "stream", self.stream)
        monkeypatch.setattr(cuda, "device", self.device)

    def current_device(self) -> int:
        return int(getattr(self._local, "device", 0))

    def set_device(self, device: int) -> None:
        self._local.device = device

    def _streams(self) -> dict[int, FakeStream]:
        if not hasattr(self._local, "streams"):
            self._local.streams = {}
        return self._local.streams  # type: ignore[no-any-return]

    def current_stream(self, device: int | torch.device | None = None) -> FakeStream:
        if isinstance(device, torch.device):
            device = device.index
        ordinal = self.current_device() if device is None else int(device)
        default = self._defaults.setdefault(
            ordinal, FakeStream(f"default{ordinal}", ordinal, self.log)
        )
        return self._streams().get(ordinal, default)

    def set_stream(self, stream: FakeStream) -> None:
        self._streams()[stream.device] = stream

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        streams = self._streams()
        previous = streams.get(stream.device)
        streams[stream.device] = stream
        self.log.append(f"enter:{stream.name}")
        try:
            with self.device(stream.device):
                yield
        finally:
            self.log.append(f"exit:{stream.name}")
            if previous is None:
                del streams[stream.device]
            else:
                streams[stream.device] = previous

    @contextlib.contextmanager
    def device(self, device: int) -> Iterator[None]:
        previous = self.current_device()
        self.set_device(int(device))
        try:
            yield
        finally:
            self.set_device(previous)
