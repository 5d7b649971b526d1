"""Fixtures of the fault tests, reused as they are from the other test packages.

- ``kv_node`` / ``live_runners``: a real node process and runner processes (tests/e2e).
- ``clock`` / ``kv_server`` / ``stub`` / ``namespace``: an in-process node on a
  `ManualClock` (tests/service), for lease and clock faults without waiting.
"""

from __future__ import annotations

from tests.e2e.conftest import kv_node, live_runners
from tests.service.conftest import channel, clock, kv_server, namespace, server_config, stub

__all__ = [
    "channel",
    "clock",
    "kv_node",
    "kv_server",
    "live_runners",
    "namespace",
    "server_config",
    "stub",
]
