"""Fixtures of the KV-event tests: skip them without the optional extra."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
pytest.importorskip("msgpack", reason="the events extra (msgpack) is not installed")
