"""The CUDA runtime seam: every call the CUDA pool makes into CUDA goes through here.

`CudaRuntime` is the small interface `kvstore.pool.cuda` needs (allocate,
export and open IPC handles, pick devices by UUID, copy, synchronise, wrap
device memory as a tensor). `CupyRuntime` implements it with
``cupy.cuda.runtime``; cupy is imported only when one is built, so this
module (and the whole package) imports without cupy. Tests swap in a fake
runtime over host memory (``tests/kvstore/pool/fake_cuda.py``) to check the
handle bookkeeping on machines without a GPU.

Errors of the runtime surface as `CudaCallFailed` with the CUDA error code,
whichever implementation raised them.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

from kvstore.pool.base import PoolUnavailable

if TYPE_CHECKING:
    import torch

IPC_HANDLE_BYTES = 64
"""Size of a ``cudaIpcMemHandle_t``."""

UUID_BYTES = 16
"""Size of a ``cudaUUID_t``."""

ERROR_MEMORY_ALLOCATION = 2
"""``cudaErrorMemoryAllocation``."""

INSTALL_HINT = "pip install 'kvstore[cuda]'"
"""What to install for CUDA pools (cupy built for CUDA 12)."""


class CudaCallFailed(RuntimeError):
    """A CUDA runtime call returned an error."""

    def __init__(self, call: str, code: int, message: str) -> None:
        super().__init__(f"{call} failed: {message} (CUDA error {code})")
        self.call = call
        """The runtime function that failed."""
        self.code = code
        """The ``cudaError_t`` it returned."""


class CudaRuntime(Protocol):
    """What the CUDA pool needs from CUDA; device arguments are ordinals of this process."""

    def device_count(self) -> int:
        """Visible GPUs (0 without a GPU or driver)."""

    def device_uuid(self, device: int) -> str:
        """The GPU's UUID as ``nvidia-smi -L`` prints it (``GPU-xxxxxxxx-xxxx-...``)."""

    def get_device(self) -> int:
        """The calling thread's current device."""

    def set_device(self, device: int) -> None:
        """Make ``device`` current for the calling thread."""

    def mem_get_info(self) -> tuple[int, int]:
        """Free and total bytes of the current device."""

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` on the current device with ``cudaMalloc``; the base pointer."""

    def free(self, ptr: int) -> None:
        """``cudaFree`` an allocation of `malloc`."""

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        """Fill device memory, synchronously."""

    def memcpy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy between any two pointers (``cudaMemcpyDefault``), synchronously for the host."""

    def synchronize(self) -> None:
        """Wait for all work on the current device."""

    def ipc_get_handle(self, ptr: int) -> bytes:
        """``cudaIpcGetMemHandle`` of an allocation's base pointer (64 bytes)."""

    def ipc_open(self, handle: bytes) -> int:
        """``cudaIpcOpenMemHandle`` with lazy peer access, on the current device."""

    def ipc_close(self, ptr: int) -> None:
        """``cudaIpcCloseMemHandle`` of a pointer `ipc_open` returned."""

    def can_access_peer(self, device: int, peer: int) -> bool:
        """Whether kernels on ``device`` can access memory of ``peer``."""

    def enable_peer(self, peer: int) -> None:
        """Let the current device access ``peer``'s memory (no error if already enabled)."""

    def as_tensor(self, ptr: int, nbytes: int, device: int, owner: object) -> torch.Tensor:
        """A flat ``uint8`` tensor over ``nbytes`` at ``ptr`` without a copy.

        The tensor keeps ``owner`` alive for as long as it (or a view of it)
        is referenced: that is what keeps the memory mapped.
        """


class CupyRuntime:
    """`CudaRuntime` on ``cupy.cuda.runtime``; views through DLPack as torch tensors."""

    def __init__(self) -> None:
        """Import cupy.

        Raises:
            PoolUnavailable: cupy is not installed (or cannot load CUDA).
        """
        try:
            import cupy
        except ImportError as exc:
            raise PoolUnavailable(
                f"CUDA pools need cupy: {INSTALL_HINT} (import failed: {exc})"
            ) from exc
        self._cupy: Any = cupy
        self._rt: Any = cupy.cuda.runtime

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._rt, name)(*args)
        except self._rt.CUDARuntimeError as exc:
            raise CudaCallFailed(name, int(getattr(exc, "status", -1)), str(exc)) from exc

    def device_count(self) -> int:
        """Visible GPUs; 0 when the driver reports none or is missing."""
        try:
            return int(self._call("getDeviceCount"))
        except CudaCallFailed:
            return 0  # cudaErrorNoDevice / cudaErrorInsufficientDriver: no usable GPU

    def device_uuid(self, device: int) -> str:
        """The GPU's UUID, formatted as ``nvidia-smi`` does.

        cupy hands ``cudaDeviceProp.uuid`` over as a C string, cut at its
        first zero byte (one GPU in ~16 has one): a short value is never
        padded or formatted, the 16 bytes are read again from the driver
        (``cuDeviceGetUuid``) or from torch.

        Raises:
            PoolUnavailable: the UUID was cut short and neither the driver
                nor torch gives the whole of it.
        """
        raw = bytes(self._call("getDeviceProperties", device)["uuid"])
        if len(raw) == UUID_BYTES:
            return format_uuid(raw)
        for source in (uuid_from_driver, uuid_from_torch):
            whole = source(device)
            if whole is not None and whole.startswith(raw):
                return format_uuid(whole)
        raise PoolUnavailable(
            f"cannot read the UUID of GPU {device}: cupy returned {len(raw)} of its 16 bytes "
            "(it stops at a zero byte) and neither libcuda nor torch gave the whole of it"
        )

    def get_device(self) -> int:
        """The calling thread's current device."""
        return int(self._call("getDevice"))

    def set_device(self, device: int) -> None:
        """Make ``device`` current for the calling thread."""
        self._call("setDevice", device)

    def mem_get_info(self) -> tuple[int, int]:
        """Free and total bytes of the current device."""
        free, total = self._call("memGetInfo")
        return int(free), int(total)

    def malloc(self, nbytes: int) -> int:
        """``cudaMalloc``: the base of its own allocation, so its IPC handle covers it all."""
        return int(self._call("malloc", nbytes))

    def free(self, ptr: int) -> None:
        """``cudaFree``."""
        self._call("free", ptr)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        """``cudaMemset``."""
        self._call("memset", ptr, value, nbytes)
        self._call("deviceSynchronize")

    def memcpy(self, dst: int, src: int, nbytes: int) -> None:
        """``cudaMemcpy`` with ``cudaMemcpyDefault`` (unified addressing picks the direction)."""
        self._call("memcpy", dst, src, nbytes, self._rt.memcpyDefault)

    def synchronize(self) -> None:
        """``cudaDeviceSynchronize``."""
        self._call("deviceSynchronize")

    def ipc_get_handle(self, ptr: int) -> bytes:
        """``cudaIpcGetMemHandle``."""
        return bytes(self._call("ipcGetMemHandle", ptr))

    def ipc_open(self, handle: bytes) -> int:
        """``cudaIpcOpenMemHandle(handle, cudaIpcMemLazyEnablePeerAccess)``."""
        return int(self._call("ipcOpenMemHandle", handle, self._rt.cudaIpcMemLazyEnablePeerAccess))

    def ipc_close(self, ptr: int) -> None:
        """``cudaIpcCloseMemHandle``."""
        self._call("ipcCloseMemHandle", ptr)

    def can_access_peer(self, device: int, peer: int) -> bool:
        """``cudaDeviceCanAccessPeer``."""
        return bool(self._call("deviceCanAccessPeer", device, peer))

    def enable_peer(self, peer: int) -> None:
        """``cudaDeviceEnablePeerAccess``; already enabled is not an error."""
        try:
            self._call("deviceEnablePeerAccess", peer)
        except CudaCallFailed as exc:
            if exc.code != _ERROR_PEER_ACCESS_ALREADY_ENABLED:
                raise

    def as_tensor(self, ptr: int, nbytes: int, device: int, owner: object) -> torch.Tensor:
        """A cupy array over unowned memory, handed to torch through DLPack (no copy).

        cupy has no bfloat16 or float8: the array is bytes, the caller views
        it with the torch dtype.
        """
        cp = self._cupy
        memory = cp.cuda.UnownedMemory(ptr, nbytes, owner, device)
        with cp.cuda.Device(device):
            array = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(memory, 0))
        from torch.utils.dlpack import from_dlpack

        return from_dlpack(array)


_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
"""``cudaErrorPeerAccessAlreadyEnabled``."""


def format_uuid(raw: bytes) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` from the 16 bytes of a ``cudaUUID_t``.

    Raises:
        ValueError: ``raw`` is not 16 bytes (a truncated UUID must never be
            formatted: it would name another GPU, or none).
    """
    if len(raw) != UUID_BYTES:
        raise ValueError(f"a GPU UUID is {UUID_BYTES} bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def uuid_from_driver(device: int) -> bytes | None:
    """The 16 UUID bytes of runtime ordinal ``device`` from ``libcuda`` (``cuDeviceGetUuid``).

    Runtime and driver ordinals agree (both follow ``CUDA_VISIBLE_DEVICES``).
    None when the driver library cannot be loaded or the call fails.
    """
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    handle = ctypes.c_int()
    out = (ctypes.c_ubyte * UUID_BYTES)()  # a byte array, not a C string: zeros are kept
    if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(handle), device) != 0:
        return None
    if lib.cuDeviceGetUuid(out, handle) != 0:
        return None
    return bytes(out)


def uuid_from_torch(device: int) -> bytes | None:
    """The 16 UUID bytes of ``device`` from torch (its ``str`` keeps zero bytes), or None."""
    try:
        import torch

        text = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # no torch, no CUDA build, an old torch without .uuid
        return None
    digits = text.removeprefix("GPU-").replace("-", "")
    try:
        raw = bytes.fromhex(digits)
    except ValueError:
        return None
    return raw if len(raw) == UUID_BYTES else None


_lock = threading.Lock()
_default: CudaRuntime | None = None


def default_runtime() -> CudaRuntime:
    """The process's runtime (`CupyRuntime`, built on first use).

    Raises:
        PoolUnavailable: cupy is missing, or no GPU is visible.
    """
    global _default
    with _lock:
        if _default is None:
            runtime = CupyRuntime()
            if runtime.device_count() == 0:
                raise PoolUnavailable(
                    "CUDA pools need an NVIDIA GPU, and this process sees none "
                    "(check the driver and CUDA_VISIBLE_DEVICES)"
                )
            _default = runtime
        return _default


def set_default_runtime(runtime: CudaRuntime | None) -> None:
    """Replace the process's runtime (tests, embedding); None goes back to cupy."""
    global _default
    with _lock:
        _default = runtime
