"""A Lookup that carries releases (``LookupRequest.release``): applied once, before
the lookup, in the same call; a bad one refuses the whole call (docs/api.md, "Lookup")."""

from __future__ import annotations

import base64
import json

import grpc
import pytest
from google.protobuf import json_format

from kvstore.v1 import kvstore_pb2 as pb
from tests.inproc import BLOCK_SIZE
from tests.service.calls import INVALID, field_of, pin, pinned, store


def carrying(
    ns: str, lease: int, chain: list[bytes], release: pb.ReleaseRequest, pin: bool = True
) -> pb.LookupRequest:
    """A packed Lookup of ``chain`` (pinned unless told) that carries ``release``."""
    return pb.LookupRequest(
        namespace_id=ns,
        lease_id=lease,
        pin=pin,
        packed_hashes=b"".join(chain),
        release=release,
    )


async def test_a_carried_release_is_applied_before_the_lookup_and_answered(stub, namespace, lease):
    ns = namespace.id
    chain = await store(stub, ns, lease, list(range(1, 1 + 4 * BLOCK_SIZE)))
    other = await store(stub, ns, lease, list(range(500, 500 + 3 * BLOCK_SIZE)))
    first = await pin(stub, ns, lease, chain, release_id=11)  # 4 blocks
    second = await pin(stub, ns, lease, other, release_id=12)  # 3 blocks
    assert await pinned(stub) == 7
    resp = await stub.Lookup(
        carrying(
            ns,
            lease,
            chain,
            pb.ReleaseRequest(packed_hashes=first + second, runs=[4, 3], release_ids=[11, 12]),
        )
    )
    # Both hits' pins were dropped, then the chain pinned again: 4 pinned.
    assert resp.hit_blocks == 4 and resp.pinned
    assert list(resp.released.run_released) == [4, 3] and resp.released.released == 7
    assert await pinned(stub) == 4
    # The same ids again (a retry, carried or as a Release): nothing is dropped twice.
    again = await stub.Lookup(
        carrying(
            ns,
            lease,
            chain,
            pb.ReleaseRequest(packed_hashes=first + second, runs=[4, 3], release_ids=[11, 12]),
            pin=False,
        )
    )
    assert list(again.released.run_released) == [4, 3]  # the first answer, repeated
    retried = await stub.Release(
        pb.ReleaseRequest(namespace_id=ns, lease_id=lease, packed_hashes=first, release_ids=[11])
    )
    assert retried.released == 4
    assert await pinned(stub) == 4  # the new lookup's pins are all still held


async def test_a_lookup_without_release_answers_no_released(stub, namespace, lease):
    ns = namespace.id
    chain = await store(stub, ns, lease, list(range(1, 1 + 2 * BLOCK_SIZE)))
    resp = await stub.Lookup(
        pb.LookupRequest(namespace_id=ns, lease_id=lease, pin=True, packed_hashes=b"".join(chain))
    )
    assert resp.hit_blocks == 2 and not resp.HasField("released")
    # One run, no ids, the namespace and lease repeated: all accepted.
    resp = await stub.Lookup(
        carrying(
            ns,
            lease,
            chain,
            pb.ReleaseRequest(namespace_id=ns, lease_id=lease, packed_hashes=b"".join(chain)),
        )
    )
    assert resp.released.released == 2 and not resp.released.run_released
    assert await pinned(stub) == 2


@pytest.mark.parametrize(
    ("release", "field"),
    [
        (dict(runs=[4, 1]), "release.runs"),  # runs that do not add up
        (dict(runs=[2, 2], release_ids=[7]), "release.release_ids"),  # one id for two runs
        (dict(release_ids=[0]), "release.release_ids"),  # a zero id
        (dict(namespace_id="another"), "release.namespace_id"),
        (dict(lease_id=999), "release.lease_id"),
    ],
)
async def test_a_bad_carried_release_applies_nothing(stub, namespace, lease, release, field):
    ns = namespace.id
    chain = await store(stub, ns, lease, list(range(1, 1 + 4 * BLOCK_SIZE)))
    hit = await pin(stub, ns, lease, chain)
    request = carrying(ns, lease, chain, pb.ReleaseRequest(packed_hashes=hit, **release))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Lookup(request)
    assert err.value.code() == INVALID and field_of(err.value) == field
    assert await pinned(stub) == 4  # the carried release dropped nothing
    # And the lookup pinned nothing: one Release of the first hit leaves no pin.
    await stub.Release(pb.ReleaseRequest(namespace_id=ns, lease_id=lease, packed_hashes=hit))
    assert await pinned(stub) == 0


async def test_bad_hashes_in_a_carried_release_apply_nothing(stub, namespace, lease):
    ns = namespace.id
    chain = await store(stub, ns, lease, list(range(1, 1 + 2 * BLOCK_SIZE)))
    hit = await pin(stub, ns, lease, chain)
    for release, field in (
        (pb.ReleaseRequest(packed_hashes=hit + b"x"), "release.packed_hashes"),
        (pb.ReleaseRequest(packed_hashes=chain[0] + b"short"), "release.packed_hashes"),
        (pb.ReleaseRequest(), "release.packed_hashes"),  # names no block
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Lookup(carrying(ns, lease, chain, release))
        assert err.value.code() == INVALID and field_of(err.value).startswith(field)
    assert await pinned(stub) == 2


async def test_a_carried_release_needs_the_lookups_lease(stub, namespace, lease):
    ns = namespace.id
    chain = await store(stub, ns, lease, list(range(1, 1 + 2 * BLOCK_SIZE)))
    hit = await pin(stub, ns, lease, chain)
    request = pb.LookupRequest(
        namespace_id=ns, packed_hashes=b"".join(chain), release=pb.ReleaseRequest(packed_hashes=hit)
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Lookup(request)
    assert err.value.code() == INVALID and field_of(err.value) == "lease_id"
    assert await pinned(stub) == 2


async def test_the_json_form_grpcurl_sends_carries_a_release(stub, namespace, lease):
    """grpcurl's JSON (reflection): ``release`` with base64 hashes and string ids."""
    ns = namespace.id
    chain = await store(stub, ns, lease, list(range(1, 1 + 2 * BLOCK_SIZE)))
    hit = await pin(stub, ns, lease, chain, release_id=7)
    body = {
        "namespaceId": ns,
        "leaseId": str(lease),
        "packedHashes": base64.b64encode(b"".join(chain)).decode(),
        "release": {"packedHashes": base64.b64encode(hit).decode(), "releaseIds": ["7"]},
    }
    request = json_format.Parse(json.dumps(body), pb.LookupRequest())
    resp = await stub.Lookup(request)
    assert resp.hit_blocks == 2 and resp.released.released == 2
    assert json_format.MessageToDict(resp)["released"] == {"released": 2}
    assert await pinned(stub) == 0  # released, and this lookup did not pin


async def test_a_lookup_reusing_a_live_release_id_applies_no_carried_release(
    stub, namespace, lease
):
    ns = namespace.id
    chain = await store(stub, ns, lease, list(range(1, 1 + 2 * BLOCK_SIZE)))
    other = await store(stub, ns, lease, list(range(500, 500 + 2 * BLOCK_SIZE)))
    await pin(stub, ns, lease, chain, release_id=5)
    second = await pin(stub, ns, lease, other, release_id=6)
    request = carrying(ns, lease, chain, pb.ReleaseRequest(packed_hashes=second, release_ids=[6]))
    request.release_id = 5  # names the first lookup's live pins
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Lookup(request)
    assert err.value.code() == INVALID and field_of(err.value) == "release_id"
    assert await pinned(stub) == 4  # neither the carried release nor the lookup happened
    request.release_id = 9
    resp = await stub.Lookup(request)
    assert resp.released.released == 2 and resp.hit_blocks == 2
    assert await pinned(stub) == 2
