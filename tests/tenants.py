"""Tenants of the auth tests: their tokens, the tenants file, calls made with a token.

The node that reads this tenants file is the ``auth_server`` fixture (tests/conftest.py).
"""

from __future__ import annotations

import hashlib

from kvstore.v1 import kvstore_pb2 as pb
from tests.inproc import LAYOUT
from tests.replies import entries_of
from tests.stand_ins import stand_in_checksums

ALICE_TOKEN = "alice-token-0123456789"
BOB_TOKEN = "bob-token-0123456789abc"
ADMIN_TOKEN = "admin-token-0123456789"
MODEL = "test-model"
OTHER_MODEL = "other-model"

TENANTS_TOML = f"""
[tenants.alice]
tokens = ["{ALICE_TOKEN}"]
namespaces = ["{MODEL}"]
max_blocks = 6
max_leases = 2

[tenants.bob]
token_sha256 = ["{hashlib.sha256(BOB_TOKEN.encode()).hexdigest()}"]
namespaces = ["*"]
"""


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a token."""
    return (("authorization", f"Bearer {token}"),)


async def register(stub, token: str, model: str = MODEL) -> pb.RegisterNamespaceResponse:
    """Register ``model`` as the tenant of ``token``."""
    return await stub.RegisterNamespace(
        pb.RegisterNamespaceRequest(model_id=model, layout=LAYOUT),
        metadata=bearer(token),
        timeout=5,
    )


async def open_lease(stub, token: str) -> int:
    resp = await stub.OpenLease(pb.OpenLeaseRequest(), metadata=bearer(token), timeout=5)
    return resp.lease_id


async def store(stub, token: str, ns: str, lease: int, tokens: list[int]) -> list[bytes]:
    """Reserve and commit the blocks of ``tokens``; returns the chain."""
    resp = await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns, lease_id=lease, tokens=tokens),
        metadata=bearer(token),
        timeout=5,
    )
    hashes = [e.hash for e in entries_of(resp) if e.status == pb.RESERVE_STATUS_RESERVED]
    if hashes:
        await stub.Commit(
            pb.CommitRequest(
                namespace_id=ns,
                lease_id=lease,
                packed_hashes=b"".join(hashes),
                packed_checksums=stand_in_checksums(b"".join(hashes)),
            ),
            metadata=bearer(token),
            timeout=5,
        )
    return [e.hash for e in entries_of(resp)]
