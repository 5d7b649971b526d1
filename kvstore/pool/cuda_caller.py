"""The calling thread's torch CUDA device and stream, carried to the thread that does the work.

torch keeps the current device and each device's current stream per thread.
`kvstore.client.SyncClient` runs every call on its own event-loop thread,
whose device is 0 and whose streams are the default ones: reading them there
would attach the pool for the wrong GPU and copy blocks on a stream that
nothing orders after the runner's kernels. So the blocking client captures
the caller's state (`capture`) when a call is made and runs the call inside
`calling_thread` (a context variable: each call is its own asyncio task, so
concurrent calls from several threads never see each other's state). The
code that reads "the current device/stream" goes through `current_torch_device`
and `caller_streams`, which prefer the captured state.

Without torch, or before torch initialised CUDA, nothing is captured and
everything reads the current thread's state as before.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class CallerCuda:
    """A thread's torch CUDA state when it made a call."""

    device: int
    """Its current device (``torch.cuda.current_device()``)."""
    stream: Any
    """That device's current stream in the thread (a ``torch.cuda.Stream``)."""


_CALLER: ContextVar[CallerCuda | None] = ContextVar("kvstore_caller_cuda", default=None)


def _torch_cuda() -> Any | None:
    """``torch.cuda`` if torch is imported and has initialised CUDA (never imports torch)."""
    torch_module = sys.modules.get("torch")
    if torch_module is None or not torch_module.cuda.is_initialized():
        return None
    return torch_module.cuda


def capture() -> CallerCuda | None:
    """The calling thread's torch device and its current stream; None without torch CUDA."""
    cuda = _torch_cuda()
    if cuda is None:
        return None
    device = int(cuda.current_device())
    return CallerCuda(device, cuda.current_stream(device))


@contextlib.contextmanager
def calling_thread(state: CallerCuda | None) -> Iterator[None]:
    """Within this block (and tasks it starts), the caller's state is `state`."""
    token = _CALLER.set(state)
    try:
        yield
    finally:
        _CALLER.reset(token)


def current_torch_device() -> int | None:
    """The caller's torch CUDA device, if torch initialised CUDA; else None.

    The captured caller's device when there is one, else the calling
    thread's. The client reads it before attaching in a worker thread (whose
    current device would be 0), so the runner's own GPU is what the peer
    check uses.
    """
    state = _CALLER.get()
    if state is not None:
        return state.device
    cuda = _torch_cuda()
    return None if cuda is None else int(cuda.current_device())


@contextlib.contextmanager
def caller_streams() -> Iterator[None]:
    """Make the captured caller's device and stream current in this thread for the block.

    Synchronous code only (no ``await`` inside): torch's current stream is
    per thread, and the event loop's thread is shared by every call. Without
    a captured caller this does nothing.
    """
    state = _CALLER.get()
    cuda = _torch_cuda()
    if state is None or cuda is None:
        yield
        return
    with cuda.device(state.device), cuda.stream(state.stream):
        yield
