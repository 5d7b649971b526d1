"""Waiting for a condition in tests: one bounded poll, in a blocking and an awaiting form.

A test that waits for something (a task to run, a node to answer, a key to appear)
polls for it here instead of sleeping a fixed time: it goes on as soon as the
condition holds, and when it never does it fails after ``within`` seconds with a
message that names what was awaited, the last value seen and, if given, a log tail.

``probe`` returns a value; without ``ok`` the value itself must be truthy, with ``ok``
the predicate decides (``ok=lambda stats: stats.pinned == 0``). ``what`` names the
condition in the failure; without it the failure quotes the condition's source line.
``within`` defaults to the 10 s most tests allowed; a test that allowed other bounds
passes them. Both forms return the
value that satisfied the condition. ``until`` also accepts a probe that returns an
awaitable (an ``async def`` probe, a stub call).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

__all__ = ["until", "wait_until"]


def _name(probe: Callable[[], Any], ok: Callable[[Any], bool], what: str | None) -> str:
    """What was awaited: ``what`` if the caller named it, else the source of the condition."""
    if what is not None:
        return what
    condition = probe if ok is bool else ok
    try:
        return inspect.getsource(condition).strip()
    except (OSError, TypeError):
        return repr(condition)


def _failure(what: str, within: float, last: object, tail: Callable[[], str] | None) -> str:
    message = f"timed out after {within:g} s waiting for {what}; last value: {last!r}"
    if tail is not None:
        message += f"\n{tail()}"
    return message


def wait_until(
    probe: Callable[[], Any],
    *,
    what: str | None = None,
    within: float = 10.0,
    interval: float = 0.05,
    ok: Callable[[Any], bool] = bool,
    tail: Callable[[], str] | None = None,
) -> Any:
    """Call ``probe()`` every ``interval`` s until ``ok`` holds for its value; return that value.

    Raises:
        AssertionError: naming ``what`` (and ``tail()``) when ``within`` s passed first.
    """
    deadline = time.monotonic() + within
    while True:
        value = probe()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(_failure(_name(probe, ok, what), within, value, tail))
        time.sleep(interval)


async def until(
    probe: Callable[[], Any],
    *,
    what: str | None = None,
    within: float = 10.0,
    interval: float = 0.01,
    ok: Callable[[Any], bool] = bool,
    tail: Callable[[], str] | None = None,
) -> Any:
    """Await ``probe()`` (sync or async) every ``interval`` s until ``ok`` holds; return its value.

    The event loop runs between probes, so the tasks the condition watches make progress.

    Raises:
        AssertionError: naming ``what`` (and ``tail()``) when ``within`` s passed first.
    """
    deadline = time.monotonic() + within
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(_failure(_name(probe, ok, what), within, value, tail))
        await asyncio.sleep(interval)
