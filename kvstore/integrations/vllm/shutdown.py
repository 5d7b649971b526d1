"""Run a connector's close on every stop a process can see: exit, SIGTERM, SIGINT.

How vLLM 0.32 stops its engine (``vllm serve``; ``LLM`` the same way): the
API server, on SIGTERM or SIGINT, calls ``AsyncLLM.shutdown(timeout=
--shutdown-timeout)``; the EngineCore process manager
(``vllm.v1.utils.shutdown``) sends EngineCore SIGTERM, waits at most
``--shutdown-timeout`` seconds for it to exit, then SIGKILLs it and its
children (``kill_process_tree``). EngineCore's own SIGTERM handler only
asks its busy loop to stop (abort in-flight requests when the timeout is 0,
let them finish otherwise); once the loop is out, ``EngineCore.shutdown``
calls the scheduler's and the workers' connector ``shutdown()``. With the
default ``--shutdown-timeout 0`` the SIGKILL follows the SIGTERM within
milliseconds: nothing in EngineCore gets to run, the connector's leases are
left to expire. With a few seconds (``--shutdown-timeout 10``) vLLM's own
path closes the connector; `on_stop` adds the stops that path misses.

`on_stop(close)` runs ``close`` once, never raising, at the first of:

- normal interpreter exit (``atexit``);
- SIGTERM or SIGINT, where the handler was Python's default (the process
  would die without running ``atexit``) or another Python handler (vLLM's
  EngineCore installs one before it builds the connector). After ``close``
  the previous handler runs; a default one is re-installed and the signal
  raised again, so the process still stops as it would have.

It cannot cover SIGKILL (vLLM's own after ``--shutdown-timeout``, the OOM
killer), ``os._exit`` (forked ``multiprocessing`` children exit that way),
a crash of the interpreter, a handler someone installs after ours (a later
``signal.signal`` or ``loop.add_signal_handler`` replaces it) or a signal
the process ignores (``SIG_IGN``: not a stop). Signal handlers are
installed only from the main thread (Python allows no other); a call from
another thread registers ``close`` for exit, and for signals once a later
call from the main thread installs them.

On a signal, ``close`` runs on a helper thread that the handler joins for at
most `SIGNAL_CLOSE_TIMEOUT` seconds: the handler interrupts the main thread
anywhere, possibly inside the connector holding a lock ``close`` needs, and
must not eat much of vLLM's ``--shutdown-timeout``. In EngineCore the close
runs before vLLM's handler, so before vLLM drains in-flight requests: the
connector's hooks must treat calls after ``close`` as a node that is gone
(compute, save nothing), never raise.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType, MethodType
from typing import Any

__all__ = ["SIGNAL_CLOSE_TIMEOUT", "on_stop"]

log = logging.getLogger(__name__)

SIGNAL_CLOSE_TIMEOUT = 2.0
"""Seconds a signal handler waits for the closes before the process goes on stopping."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

Handler = Callable[[int, FrameType | None], Any] | int | None
"""What ``signal.getsignal`` answers: a callable, SIG_DFL, SIG_IGN, or None (set from C)."""


@dataclass(slots=True)
class _Close:
    """One registered close: run at most once, only in the process that registered it."""

    target: Callable[[], Callable[[], None] | None]
    """Gives the close, or None once its object is gone (bound methods are held weakly)."""
    pid: int
    """A forked child inherits the registry; it must never close its parent's connector."""
    done: bool = False


_lock = threading.Lock()  # guards the bookkeeping below, never held while a close runs
_closes: list[_Close] = []
_previous: dict[int, Handler] = {}  # signal -> the handler we replaced (main thread only)
_atexit_registered = False


def on_stop(close: Callable[[], None]) -> None:
    """Arrange for ``close`` to run once, never raising, when this process stops.

    Args:
        close: Ends what must not outlive the process (the connector's leases).
            A bound method is held weakly: registering does not keep its object
            alive, and a collected object is not closed.
    """
    global _atexit_registered
    target: Callable[[], Callable[[], None] | None] = (
        weakref.WeakMethod(close) if isinstance(close, MethodType) else _strongly(close)
    )
    with _lock:
        _closes.append(_Close(target, os.getpid()))
        if not _atexit_registered:
            atexit.register(_run_closes)
            _atexit_registered = True
    if threading.current_thread() is threading.main_thread():
        _install_signal_handlers()


def _strongly(close: Callable[[], None]) -> Callable[[], Callable[[], None]]:
    return lambda: close


def _install_signal_handlers() -> None:
    # Main thread only (Python's rule), so installs never race; no lock: a signal
    # arriving here runs `_handle` on this thread, which must not wait for us.
    for signum in STOP_SIGNALS:
        current = signal.getsignal(signum)
        if current is _handle:
            continue
        if current == signal.SIG_IGN or current is None:
            continue  # ignored: not a stop; None: a C handler we cannot chain to
        _previous[signum] = current
        signal.signal(signum, _handle)


def _handle(signum: int, frame: FrameType | None) -> None:
    """Our handler: the closes (bounded), then whatever the signal did before us."""
    closer = threading.Thread(target=_run_closes, name="kvstore-on-stop", daemon=True)
    closer.start()
    closer.join(SIGNAL_CLOSE_TIMEOUT)
    if closer.is_alive():
        log.warning("kvstore: close still running after %.0f s, stopping", SIGNAL_CLOSE_TIMEOUT)
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)  # e.g. vLLM's, or KeyboardInterrupt for SIGINT
    elif previous == signal.SIG_DFL:
        # Stop as the process would have without us: the default action, exit by signal.
        # No lock here: the main thread may have been interrupted holding it.
        _previous.pop(signum, None)
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


def _run_closes() -> None:
    """Run every close registered in this process not yet run, newest first; never raises."""
    pid = os.getpid()
    with _lock:
        pending = [c for c in reversed(_closes) if not c.done and c.pid == pid]
        for entry in pending:
            entry.done = True  # claimed: a signal during atexit (or the reverse) skips it
        _closes[:] = [c for c in _closes if not c.done and c.pid == pid]
    for entry in pending:
        close = entry.target()
        if close is None:
            continue
        try:
            close()
        except BaseException:  # never raising: the process is stopping whatever happens
            with contextlib.suppress(Exception):
                log.exception("kvstore: close on stop failed")
