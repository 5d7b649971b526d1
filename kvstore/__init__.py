"""kvstore: a standalone KV-cache service for LLM inference.

The core (hashing, block table, leases, store) is pure and synchronous; the
pools in `kvstore.pool` own shared memory; `kvstore.client` is the runner SDK.
"""

from __future__ import annotations

from kvstore.block import BlockState
from kvstore.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    LayoutConflict,
    LeaseExpired,
    LimitExceeded,
    NotFound,
    NotWriter,
    PermissionDenied,
    StaleSlot,
    UnknownLease,
    UnknownNamespace,
)
from kvstore.events import CacheEvent, EventKind
from kvstore.hashing import HashScheme, hash_blocks, kvstore_root, vllm_root
from kvstore.layout import KVLayout, NamespaceSpec
from kvstore.limits import StoreLimits
from kvstore.results import (
    BlockInfo,
    BlockRef,
    ClearReport,
    ExpiryReport,
    LookupResult,
    MissReason,
    NamespaceStats,
    ReleaseReport,
    ReserveEntry,
    ReserveResult,
    ReserveStatus,
)
from kvstore.store import Store, StoreStats
from kvstore.types import BlockHash, LeaseId, NamespaceId, SlotId, TenantId

__version__ = "0.1.0"

__all__ = [
    "AlreadyExists",
    "BlockHash",
    "BlockInfo",
    "BlockRef",
    "BlockState",
    "CacheEvent",
    "ClearReport",
    "EventKind",
    "ExpiryReport",
    "FailedPrecondition",
    "HashScheme",
    "InvalidArgument",
    "KVLayout",
    "KVStoreError",
    "LayoutConflict",
    "LeaseExpired",
    "LeaseId",
    "LimitExceeded",
    "LookupResult",
    "MissReason",
    "NamespaceId",
    "NamespaceSpec",
    "NamespaceStats",
    "NotFound",
    "NotWriter",
    "PermissionDenied",
    "ReleaseReport",
    "ReserveEntry",
    "ReserveResult",
    "ReserveStatus",
    "SlotId",
    "StaleSlot",
    "Store",
    "StoreLimits",
    "StoreStats",
    "TenantId",
    "UnknownLease",
    "UnknownNamespace",
    "__version__",
    "hash_blocks",
    "kvstore_root",
    "vllm_root",
]
