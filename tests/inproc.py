"""The in-process test node's constants and helpers: its tiny layout, a manual clock.

The fixtures that start the node (``server_config``, ``clock``, ``kv_server``,
``channel``, ``stub``, ``lease``, ``namespace``) are in tests/conftest.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvstore.v1 import kvstore_pb2 as pb

BLOCK_SIZE = 4
"""Tokens per block of the test layout."""

LAYOUT = pb.KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=4, block_size=BLOCK_SIZE, dtype="float16"
)
"""A tiny layout: 2 * 2 layers * 4 tokens * 2 heads * 4 dims * 2 bytes = 256 bytes a block."""

BLOCK_BYTES = 256


class ManualClock:
    """Monotonic time plus an offset that tests can push forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        """Move the server's notion of now forward by ``seconds``."""
        self.offset += seconds


def tenant(name: str) -> tuple[tuple[str, str], ...]:
    """Call metadata naming a tenant."""
    return (("x-kvstore-tenant", name),)


@dataclass
class RegisteredNamespace:
    """A namespace registered on the test server."""

    id: str
    block_bytes: int
    capacity: int
    chain_root: bytes
