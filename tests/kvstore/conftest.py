"""Shared builders for the core tests: a tiny namespace and prompt helpers."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvstore import KVLayout, LeaseId, NamespaceSpec, Store, TenantId
from kvstore.hashing import hash_blocks, kvstore_root
from kvstore.types import BlockHash

BLOCK = 4
SPEC = NamespaceSpec("test-model", KVLayout(2, 2, 8, BLOCK, "float16"))
NS = SPEC.namespace_id
ALICE = TenantId("alice")
BOB = TenantId("bob")


def chain(tokens: Sequence[int], salt: bytes = b"alice-salt") -> list[BlockHash]:
    """Block hashes of a prompt in the test namespace for one tenant salt."""
    return hash_blocks(kvstore_root(SPEC.digest(), salt), list(tokens), BLOCK)


def prompt(system: int, user: int, system_blocks: int = 3, user_blocks: int = 2) -> list[int]:
    """A prompt: ``system_blocks`` of system prompt ``system`` then a user part."""
    sys_tokens = [1000 * system + i for i in range(system_blocks * BLOCK)]
    user_tokens = [500_000 + 1000 * user + i for i in range(user_blocks * BLOCK)]
    return sys_tokens + user_tokens


class Runner:
    """A lease-holding client of the store, as a runner would drive it."""

    def __init__(self, store: Store, lease_id: int, tenant: TenantId = ALICE) -> None:
        self.store = store
        self.lease = LeaseId(lease_id)
        self.tenant = tenant
        store.open_lease(self.lease, tenant, ttl=10.0, now=0.0)

    def store_chain(self, hashes: Sequence[BlockHash], now: float = 1.0) -> int:
        """Reserve and commit every missing block; returns how many were written."""
        result = self.store.reserve(NS, self.tenant, self.lease, hashes, now)
        written = [e.hash for e in result.reserved]
        if written:
            self.store.commit(NS, self.tenant, self.lease, written, now)
        return len(written)

    def hits(self, hashes: Sequence[BlockHash], now: float = 2.0, pin: bool = False) -> int:
        """Leading hit blocks of a chain."""
        lease = self.lease if pin else None
        return self.store.lookup(NS, self.tenant, hashes, now, lease_id=lease).hit_blocks


@pytest.fixture
def store() -> Store:
    s = Store()
    s.register_namespace(SPEC, capacity=64)
    return s
