"""Raw-stub calls the service tests share.

Store a chain, pin it (packed forms), count pins, expect an error.
"""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvstore.v1 import kvstore_pb2 as pb
from tests.replies import entries_of
from tests.stand_ins import stand_in_checksums

INVALID = grpc.StatusCode.INVALID_ARGUMENT


async def store(stub, ns: str, lease: int, tokens: list[int]) -> list[bytes]:
    """Reserve and commit every block of ``tokens``; its chain."""
    reserved = await stub.Reserve(pb.ReserveRequest(namespace_id=ns, lease_id=lease, tokens=tokens))
    hashes = [e.hash for e in entries_of(reserved)]
    await stub.Commit(
        pb.CommitRequest(
            namespace_id=ns,
            lease_id=lease,
            packed_hashes=b"".join(hashes),
            packed_checksums=stand_in_checksums(b"".join(hashes)),
        )
    )
    return hashes


def field_of(err: grpc.aio.AioRpcError) -> str:
    """The field a BadRequest violation names."""
    status = rpc_status.from_call(err)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    return bad.field_violations[0].field


async def pin(stub, ns: str, lease: int, hashes: list[bytes], release_id: int = 0) -> bytes:
    """Pin the leading hits of a chain (packed forms), named by ``release_id`` if
    given; their hashes, packed."""
    hit = await stub.Lookup(
        pb.LookupRequest(
            namespace_id=ns,
            lease_id=lease,
            pin=True,
            packed_hashes=b"".join(hashes),
            release_id=release_id,
        )
    )
    assert hit.pinned
    return hit.hit_hashes


async def pinned(stub) -> int:
    return (await stub.Stats(pb.StatsRequest())).namespaces[0].pinned


async def expect(stub, code: grpc.StatusCode, words: str, call) -> grpc.aio.AioRpcError:
    """Await ``call``; it must fail with ``code`` and a message containing ``words``."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        result = await call if not hasattr(call, "__aiter__") else [m async for m in call]
        del result
    assert err.value.code() == code, err.value.details()
    assert words.lower() in err.value.details().lower(), err.value.details()
    assert (await stub.Ping(pb.PingRequest(payload=b"ok"))).payload == b"ok"
    return err.value
