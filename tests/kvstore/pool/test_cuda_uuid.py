"""GPU UUIDs with a zero byte: cupy cuts ``cudaDeviceProp.uuid`` at it (a C string).

About one GPU in sixteen has a zero among its 16 UUID bytes. A cut UUID would
be formatted into another GPU's name (or none), so the pool's GPU would be
"not visible" to its own runners. These tests fake cupy and libcuda.
"""

from __future__ import annotations

import ctypes
import sys
import types

import pytest

from kvstore.pool import PoolUnavailable, cuda_runtime
from kvstore.pool.cuda_runtime import CupyRuntime, format_uuid

WHOLE = bytes.fromhex("5a1f00e3b2c44d1e9a0b7c6d5e4f3a21")  # a zero at byte 2
WANT = "GPU-5a1f00e3-b2c4-4d1e-9a0b-7c6d5e4f3a21"


def fake_cupy(uuid_value: bytes) -> types.ModuleType:
    """A cupy whose getDeviceProperties returns ``uuid_value`` as cupy does (bytes)."""

    class CUDARuntimeError(Exception):
        status = 1

    runtime = types.SimpleNamespace(
        CUDARuntimeError=CUDARuntimeError,
        getDeviceProperties=lambda device: {"uuid": uuid_value, "name": b"Fake"},
        getDeviceCount=lambda: 1,
    )
    module = types.ModuleType("cupy")
    module.cuda = types.SimpleNamespace(runtime=runtime)  # type: ignore[attr-defined]
    return module


def c_string(raw: bytes) -> bytes:
    """What Cython makes of a ``char[16]``: the bytes up to the first zero."""
    return raw.split(b"\0", 1)[0]


@pytest.fixture
def no_fallbacks(monkeypatch):
    monkeypatch.setattr(cuda_runtime, "uuid_from_driver", lambda device: None)
    monkeypatch.setattr(cuda_runtime, "uuid_from_torch", lambda device: None)


def test_whole_uuid_from_cupy_is_formatted(monkeypatch, no_fallbacks):
    raw = bytes(range(1, 17))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(raw))
    assert CupyRuntime().device_uuid(0) == format_uuid(raw)


def test_uuid_cut_at_a_zero_byte_is_read_from_the_driver(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(c_string(WHOLE)))
    monkeypatch.setattr(cuda_runtime, "uuid_from_driver", lambda device: WHOLE)
    assert CupyRuntime().device_uuid(0) == WANT


def test_uuid_cut_at_a_zero_byte_falls_back_to_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(c_string(WHOLE)))
    monkeypatch.setattr(cuda_runtime, "uuid_from_driver", lambda device: None)
    monkeypatch.setattr(cuda_runtime, "uuid_from_torch", lambda device: WHOLE)
    assert CupyRuntime().device_uuid(0) == WANT


def test_uuid_cut_with_no_way_to_read_it_whole_is_a_clear_error(monkeypatch, no_fallbacks):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(c_string(WHOLE)))
    with pytest.raises(PoolUnavailable, match="2 of its 16 bytes"):
        CupyRuntime().device_uuid(0)


def test_a_fallback_for_another_gpu_is_not_taken(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(c_string(WHOLE)))
    other = bytes.fromhex("ffff00e3b2c44d1e9a0b7c6d5e4f3a21")
    monkeypatch.setattr(cuda_runtime, "uuid_from_driver", lambda device: other)
    monkeypatch.setattr(cuda_runtime, "uuid_from_torch", lambda device: None)
    with pytest.raises(PoolUnavailable, match="UUID"):
        CupyRuntime().device_uuid(0)


def test_format_uuid_refuses_a_cut_uuid():
    with pytest.raises(ValueError, match="16 bytes"):
        format_uuid(c_string(WHOLE))


class FakeLibcuda:
    """``cuInit``, ``cuDeviceGet`` and ``cuDeviceGetUuid`` writing ``WHOLE`` (zero included)."""

    def cuInit(self, flags):
        return 0

    def cuDeviceGet(self, out, ordinal):
        out._obj.value = ordinal
        return 0

    def cuDeviceGetUuid(self, out, device):
        ctypes.memmove(out, WHOLE, len(WHOLE))
        return 0


def test_driver_uuid_keeps_zero_bytes(monkeypatch):
    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeLibcuda())
    assert cuda_runtime.uuid_from_driver(0) == WHOLE


def test_driver_uuid_without_libcuda_is_none(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert cuda_runtime.uuid_from_driver(0) is None


def test_torch_uuid_is_parsed_with_its_zero_bytes(monkeypatch):
    import torch

    props = types.SimpleNamespace(uuid="5a1f00e3-b2c4-4d1e-9a0b-7c6d5e4f3a21")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert cuda_runtime.uuid_from_torch(0) == WHOLE


def test_torch_uuid_without_cuda_is_none():
    # CPU torch (this machine): get_device_properties raises; no UUID, no crash.
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert cuda_runtime.uuid_from_torch(0) is None
