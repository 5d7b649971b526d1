"""Checksums on the wire: Commit keeps the writer's, Lookup and FetchBlocks send them
back, WriteBlocks checks them, bad lengths are INVALID_ARGUMENT."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest

from kvstore.checksum import block_checksum, pack_checksums, unpack_checksums
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.server import Server
from tests.inproc import LAYOUT
from tests.replies import blocks_of
from tests.service.calls import INVALID, expect

H1, H2 = b"\x01" * 32, b"\x02" * 32


async def reserve(stub, ns: str, lease: int, hashes: list[bytes]) -> None:
    await stub.Reserve(
        pb.ReserveRequest(namespace_id=ns, lease_id=lease, packed_hashes=b"".join(hashes))
    )


async def test_commit_keeps_checksums_and_lookup_answers_them(stub, namespace, lease) -> None:
    ns = namespace.id
    await reserve(stub, ns, lease, [H1, H2])
    sums = [0x1122334455667788, 0x99AABBCCDDEEFF00]
    commit = pb.CommitRequest(
        namespace_id=ns,
        lease_id=lease,
        packed_hashes=H1 + H2,
        packed_checksums=pack_checksums(sums),
    )
    assert (await stub.Commit(commit)).committed == 2
    packed = await stub.Lookup(pb.LookupRequest(namespace_id=ns, packed_hashes=b"".join([H1, H2])))
    assert list(unpack_checksums(packed.packed_checksums, 2)) == sums
    assert [b.checksum for b in blocks_of(packed)] == sums


async def test_a_checksum_length_that_does_not_match_the_hashes_is_invalid(
    stub, namespace, lease
) -> None:
    ns = namespace.id
    await reserve(stub, ns, lease, [H1, H2])
    for bad in (bytes(8), bytes(17), bytes(24)):
        request = pb.CommitRequest(
            namespace_id=ns, lease_id=lease, packed_hashes=b"".join([H1, H2]), packed_checksums=bad
        )
        await expect(stub, INVALID, f"packed_checksums: is {len(bad)} bytes", stub.Commit(request))
    # Nothing was committed by the refused calls.
    found = await stub.Lookup(pb.LookupRequest(namespace_id=ns, packed_hashes=b"".join([H1])))
    assert found.hit_blocks == 0


@pytest.mark.parametrize("sums", [None, [0x1122334455667788, 0], [0, 0]])
async def test_a_host_pool_commit_without_a_checksum_for_every_block_is_invalid(
    stub, namespace, lease, sums: list[int] | None
) -> None:
    # Issue 40, item 3: a Commit that left the checksums out (or sent 0) was
    # taken as "none", and every reader then skipped its check of those blocks.
    ns = namespace.id
    await reserve(stub, ns, lease, [H1, H2])
    request = pb.CommitRequest(
        namespace_id=ns,
        lease_id=lease,
        packed_hashes=H1 + H2,
        packed_checksums=b"" if sums is None else pack_checksums(sums),
    )
    await expect(stub, INVALID, "packed_checksums: block", stub.Commit(request))
    found = await stub.Lookup(pb.LookupRequest(namespace_id=ns, packed_hashes=H1 + H2))
    assert found.hit_blocks == 0  # nothing was committed by the refused call


async def test_write_blocks_without_a_checksum_keeps_the_one_of_the_bytes_received(
    stub, namespace, lease
) -> None:
    ns = namespace.id
    await reserve(stub, ns, lease, [H1])
    data = bytes(range(256)) * (namespace.block_bytes // 256)

    async def messages() -> AsyncIterator[pb.WriteBlocksRequest]:
        header = pb.WriteBlocksHeader(namespace_id=ns, lease_id=lease, commit=True)
        yield pb.WriteBlocksRequest(header=header)
        yield pb.WriteBlocksRequest(block=pb.BlockData(hash=H1, data=data))  # no checksum

    assert (await stub.WriteBlocks(messages())).committed == 1
    found = await stub.Lookup(pb.LookupRequest(namespace_id=ns, packed_hashes=H1))
    assert blocks_of(found)[0].checksum == block_checksum(data)  # never 0


async def test_write_blocks_refuses_data_that_does_not_have_its_checksum(
    stub, namespace, lease
) -> None:
    ns = namespace.id
    await reserve(stub, ns, lease, [H1])
    data = bytes(range(256)) * (namespace.block_bytes // 256)

    def write(checksum: int) -> AsyncIterator[pb.WriteBlocksRequest]:
        async def messages() -> AsyncIterator[pb.WriteBlocksRequest]:
            header = pb.WriteBlocksHeader(namespace_id=ns, lease_id=lease, commit=True)
            yield pb.WriteBlocksRequest(header=header)
            block = pb.BlockData(hash=H1, data=data, checksum=checksum)
            yield pb.WriteBlocksRequest(block=block)

        return messages()

    await expect(stub, INVALID, "checksum", stub.WriteBlocks(write(block_checksum(data) ^ 1)))
    assert (await stub.WriteBlocks(write(block_checksum(data)))).committed == 1
    found = await stub.Lookup(pb.LookupRequest(namespace_id=ns, packed_hashes=b"".join([H1])))
    assert blocks_of(found)[0].checksum == block_checksum(data)


async def test_fetch_blocks_sends_the_stored_checksum(stub, namespace, lease) -> None:
    ns = namespace.id
    await reserve(stub, ns, lease, [H1])
    commit = pb.CommitRequest(
        namespace_id=ns,
        lease_id=lease,
        packed_hashes=b"".join([H1]),
        packed_checksums=pack_checksums([42]),
    )
    await stub.Commit(commit)
    call = stub.FetchBlocks(pb.FetchBlocksRequest(namespace_id=ns, tenant="default", hashes=[H1]))
    items = [item async for item in call]
    assert [item.checksum for item in items] == [42]  # the writer's, not the bytes' now


@pytest.mark.parametrize(("setting", "advertised"), [("peer", False), ("all", True)])
async def test_register_namespace_advertises_local_verification(
    server_config, clock, setting: str, advertised: bool
) -> None:
    server = Server(dataclasses.replace(server_config, verify_checksums=setting), clock=clock)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            resp = await stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(model_id="m", layout=LAYOUT)
            )
            assert resp.verify_local_loads is advertised
    finally:
        await server.stop(0.1)


async def test_a_release_reporting_corrupt_blocks_with_a_bad_length_is_invalid(
    stub, namespace, lease
) -> None:
    request = pb.ReleaseRequest(
        namespace_id=namespace.id, lease_id=lease, packed_hashes=H1, packed_corrupt=bytes(33)
    )
    await expect(stub, INVALID, "packed_corrupt", stub.Release(request))
