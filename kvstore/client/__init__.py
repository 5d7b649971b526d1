"""The runner SDK: an async `Client`, a `SyncClient` wrapper and what they return.

Control goes over gRPC; block bytes are read and written in place through
the node's pool mapped into this process (`kvstore.pool`).
"""

from __future__ import annotations

from kvstore.client.blocks import BlockSource, BlockSupplier
from kvstore.client.client import Client
from kvstore.client.errors import (
    BlocksMoved,
    DeadlineExceeded,
    PoolEpochChanged,
    ServerError,
    ServerUnavailable,
    Unauthenticated,
    error_from_rpc,
    error_from_status,
)
from kvstore.client.handles import Namespace, StoreResult
from kvstore.client.hit import BlockLocation, Hit, Verification
from kvstore.client.lease_keeper import LeaseGrant, LeaseKeeper
from kvstore.client.query import PrefixAnswer, PrefixHolder
from kvstore.client.retry import Backoff, RetryPolicy
from kvstore.client.sharded import ShardedClient, ShardedNamespace, shard_of
from kvstore.client.sync import SyncClient
from kvstore.client.tls import TLSOptions

__all__ = [
    "Backoff",
    "BlockLocation",
    "BlocksMoved",
    "BlockSource",
    "BlockSupplier",
    "Client",
    "DeadlineExceeded",
    "Hit",
    "LeaseGrant",
    "LeaseKeeper",
    "Namespace",
    "PoolEpochChanged",
    "PrefixAnswer",
    "PrefixHolder",
    "RetryPolicy",
    "ServerError",
    "ServerUnavailable",
    "ShardedClient",
    "ShardedNamespace",
    "StoreResult",
    "SyncClient",
    "TLSOptions",
    "Unauthenticated",
    "Verification",
    "error_from_rpc",
    "error_from_status",
    "shard_of",
]
