"""Distinct id types shared by the core, the pools, the client and the service.

They are `NewType`s, so mypy keeps a slot from being passed where a lease id is
expected, at no run-time cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

from kvstore.errors import InvalidArgument

BlockHash = NewType("BlockHash", bytes)
"""32-byte chained prefix hash of one full block (see `kvstore.hashing`)."""

SlotId = NewType("SlotId", int)
"""Index of a block-sized slot in a namespace's pool, 0 ≤ slot < capacity."""

LeaseId = NewType("LeaseId", int)
"""Unguessable 63-bit id of a lease; pins and WRITING slots belong to one."""

TenantId = NewType("TenantId", str)
"""Name of a tenant; blocks of different tenants live in separate scopes."""

NamespaceId = NewType("NamespaceId", str)
"""16 hex characters derived from model id + KV layout + hash scheme."""

HASH_BYTES = 32
"""Length of every `BlockHash`."""

MAX_CHAIN_BLOCKS = 16384
"""Longest chain one call may name, by default: `kvstore.limits.StoreLimits` and the
node's ``max_chain_blocks`` setting (the operator's knob) both start from it."""

SHARED_SCOPE = TenantId("")
"""The scope of a namespace configured as shared between tenants."""


def check_hashes(chain: Sequence[BlockHash]) -> None:
    """Raise `kvstore.errors.InvalidArgument` unless every item is a HASH_BYTES-long bytes."""
    # Fast path, two passes in C (a 512-block chain is checked per lookup):
    # exact bytes of the right length. Anything else takes the loop below,
    # which accepts bytes subclasses and names what was wrong.
    if set(map(type, chain)) <= {bytes} and set(map(len, chain)) <= {HASH_BYTES}:
        return
    for h in chain:
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise InvalidArgument(
                f"every block hash must be {HASH_BYTES} bytes, got "
                f"{len(h) if isinstance(h, bytes) else type(h).__name__}"
            )
