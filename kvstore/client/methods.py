"""The RPCs of the KVStore service as typed values, one constant per RPC.

`Rpc.call(LOOKUP, request, ...)` is checked end to end by mypy: the request
must be a `LookupRequest` and the reply is a `LookupResponse`, where a call by
name (``"Lookup"``) took and returned `Any`. The kind of call is in the type
too: `Rpc.call` takes a `Unary`, `Rpc.send` a `ClientStream`, `Rpc.stream` a
`ServerStream`. The table follows proto/kvstore/v1/kvstore.proto;
tests/client/test_methods.py checks it against the service's descriptor
(every RPC, its message types and its streaming), so it cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from google.protobuf.message import Message

from kvstore.v1 import kvstore_pb2 as pb

Req = TypeVar("Req", bound=Message)
Rep = TypeVar("Rep", bound=Message)


@dataclass(frozen=True, slots=True)
class Unary(Generic[Req, Rep]):
    """An RPC of one request and one reply."""

    name: str
    """The RPC's name in the proto service (the stub's attribute)."""
    request: type[Req]
    """Its request message."""
    reply: type[Rep]
    """Its reply message."""


@dataclass(frozen=True, slots=True)
class ServerStream(Generic[Req, Rep]):
    """An RPC of one request and a stream of replies."""

    name: str
    """The RPC's name in the proto service (the stub's attribute)."""
    request: type[Req]
    """Its request message."""
    reply: type[Rep]
    """The message of each item of its reply stream."""


@dataclass(frozen=True, slots=True)
class ClientStream(Generic[Req, Rep]):
    """An RPC of a stream of requests and one reply."""

    name: str
    """The RPC's name in the proto service (the stub's attribute)."""
    request: type[Req]
    """The message of each item of its request stream."""
    reply: type[Rep]
    """Its reply message."""


# Leases.
OPEN_LEASE = Unary("OpenLease", pb.OpenLeaseRequest, pb.OpenLeaseResponse)
KEEP_ALIVE = Unary("KeepAlive", pb.KeepAliveRequest, pb.KeepAliveResponse)
CLOSE_LEASE = Unary("CloseLease", pb.CloseLeaseRequest, pb.CloseLeaseResponse)
# Namespaces and the pool that backs them.
REGISTER_NAMESPACE = Unary(
    "RegisterNamespace", pb.RegisterNamespaceRequest, pb.RegisterNamespaceResponse
)
ATTACH_POOL = Unary("AttachPool", pb.AttachPoolRequest, pb.AttachPoolResponse)
# Block operations.
LOOKUP = Unary("Lookup", pb.LookupRequest, pb.LookupResponse)
RESERVE = Unary("Reserve", pb.ReserveRequest, pb.ReserveResponse)
COMMIT = Unary("Commit", pb.CommitRequest, pb.CommitResponse)
ABORT = Unary("Abort", pb.AbortRequest, pb.AbortResponse)
RELEASE = Unary("Release", pb.ReleaseRequest, pb.ReleaseResponse)
# Bytes over gRPC.
READ_BLOCKS = ServerStream("ReadBlocks", pb.ReadBlocksRequest, pb.BlockData)
WRITE_BLOCKS = ClientStream("WriteBlocks", pb.WriteBlocksRequest, pb.WriteBlocksResponse)
# Node to node.
FETCH_BLOCKS = ServerStream("FetchBlocks", pb.FetchBlocksRequest, pb.BlockData)
OFFER_BLOCKS = Unary("OfferBlocks", pb.OfferBlocksRequest, pb.OfferBlocksResponse)
END_OFFER = Unary("EndOffer", pb.EndOfferRequest, pb.EndOfferResponse)
# Inspection.
STATS = Unary("Stats", pb.StatsRequest, pb.StatsResponse)
LIST_BLOCKS = Unary("ListBlocks", pb.ListBlocksRequest, pb.ListBlocksResponse)
WATCH_EVENTS = ServerStream("WatchEvents", pb.WatchEventsRequest, pb.Event)
PING = Unary("Ping", pb.PingRequest, pb.PingResponse)
QUERY_PREFIX = Unary("QueryPrefix", pb.QueryPrefixRequest, pb.QueryPrefixResponse)
# Admin verbs.
EVICT = Unary("Evict", pb.EvictRequest, pb.EvictResponse)
CLEAR = Unary("Clear", pb.ClearRequest, pb.ClearResponse)
DROP_NAMESPACE = Unary("DropNamespace", pb.DropNamespaceRequest, pb.DropNamespaceResponse)
