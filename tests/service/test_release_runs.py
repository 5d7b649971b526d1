"""`Release` with ``runs``: several hits' pins dropped in one call, each run
exactly as its own `Release` would drop it (docs/api.md, "Release")."""

from __future__ import annotations

import grpc
import pytest

from kvstore.api import wire
from kvstore.v1 import kvstore_pb2 as pb
from tests.inproc import BLOCK_SIZE
from tests.service.calls import INVALID, field_of, pin, pinned, store


async def test_runs_release_each_hit_and_count_each(stub, namespace, lease):
    ns = namespace.id
    chain = await store(stub, ns, lease, list(range(1, 1 + 4 * BLOCK_SIZE)))
    other = await store(stub, ns, lease, list(range(500, 500 + 3 * BLOCK_SIZE)))
    first = await pin(stub, ns, lease, chain)  # 4 blocks
    second = await pin(stub, ns, lease, chain[:2])  # the same first 2 blocks, pinned again
    third = await pin(stub, ns, lease, other)  # 3 blocks
    assert await pinned(stub) == 7  # distinct blocks pinned
    resp = await stub.Release(
        pb.ReleaseRequest(
            namespace_id=ns,
            lease_id=lease,
            packed_hashes=first + second + third + second,  # the last run: pins already gone
            runs=[4, 2, 3, 2],
        )
    )
    assert list(resp.run_released) == [4, 2, 3, 0]
    assert resp.released == 9
    assert await pinned(stub) == 0


async def test_runs_that_do_not_add_up_or_are_too_long_are_refused(stub, namespace, lease):
    ns = namespace.id
    chain = await store(stub, ns, lease, list(range(1, 1 + 4 * BLOCK_SIZE)))
    hit = await pin(stub, ns, lease, chain)
    for runs, field in (([4, 1], "runs"), ([3], "runs"), ([16_385, 0], "runs")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Release(
                pb.ReleaseRequest(namespace_id=ns, lease_id=lease, packed_hashes=hit, runs=runs)
            )
        assert err.value.code() == INVALID and field_of(err.value) == field
    assert await pinned(stub) == 4  # nothing was released by a refused call
    resp = await stub.Release(
        pb.ReleaseRequest(namespace_id=ns, lease_id=lease, packed_hashes=hit, runs=[1, 3])
    )
    assert list(resp.run_released) == [1, 3] and await pinned(stub) == 0


async def test_runs_are_bounded_before_any_work(stub, namespace, lease):
    """No more runs than hashes, none empty, at most MAX_RELEASE_RUNS: each run is one
    release on the loop, so a flood of empty runs is refused before any is released."""
    ns = namespace.id
    chain = await store(stub, ns, lease, list(range(1, 1 + 4 * BLOCK_SIZE)))
    hit = await pin(stub, ns, lease, chain)
    cases = {
        "empty run": ([4, 0], hit, "empty"),
        "more runs than hashes": ([1, 1, 1, 1, 0], hit, "5 runs for 4 hashes"),
        "over the cap": (
            [1] * (wire.MAX_RELEASE_RUNS + 1),
            hit * (wire.MAX_RELEASE_RUNS // 4 + 1),
            f"at most {wire.MAX_RELEASE_RUNS} per call",
        ),
    }
    for name, (runs, packed, says) in cases.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Release(
                pb.ReleaseRequest(namespace_id=ns, lease_id=lease, packed_hashes=packed, runs=runs)
            )
        assert err.value.code() == INVALID and field_of(err.value) == "runs", name
        assert says in err.value.details(), (name, err.value.details())
    assert await pinned(stub) == 4  # nothing was released by a refused call
    resp = await stub.Release(  # the cap itself is allowed
        pb.ReleaseRequest(
            namespace_id=ns,
            lease_id=lease,
            packed_hashes=hit * (wire.MAX_RELEASE_RUNS // 4),
            runs=[1] * wire.MAX_RELEASE_RUNS,
        )
    )
    assert resp.released == 4 and await pinned(stub) == 0


async def test_a_release_id_is_applied_once_per_lease(stub, namespace, lease):
    """Two hits of one lease pin the same blocks, each lookup naming its pins by an
    id; the first hit's Release, sent twice under its id (a retry after a lost
    answer), drops its pins once: the second hit's stay. With runs, each run
    has its id."""
    ns = namespace.id
    chain = await store(stub, ns, lease, list(range(1, 1 + 3 * BLOCK_SIZE)))
    hit = await pin(stub, ns, lease, chain, release_id=7)
    await pin(stub, ns, lease, chain, release_id=8)  # the same 3 blocks pinned again
    mine = pb.ReleaseRequest(namespace_id=ns, lease_id=lease, packed_hashes=hit, release_ids=[7])
    assert (await stub.Release(mine)).released == 3
    assert (await stub.Release(mine)).released == 3  # the first answer, nothing dropped
    assert await pinned(stub) == 3  # the other hit's pins
    both = pb.ReleaseRequest(
        namespace_id=ns, lease_id=lease, packed_hashes=hit + hit, runs=[3, 3], release_ids=[7, 8]
    )
    resp = await stub.Release(both)  # 7 again: nothing; 8: the other hit's pins
    assert list(resp.run_released) == [3, 3] and await pinned(stub) == 0
    for ids, says in (([7, 8, 9], "3 ids for 2 runs"), ([7, 0], "is 0")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Release(
                pb.ReleaseRequest(
                    namespace_id=ns, lease_id=lease, packed_hashes=hit, runs=[1, 2], release_ids=ids
                )
            )
        assert err.value.code() == INVALID and field_of(err.value) == "release_ids"
        assert says in err.value.details(), err.value.details()


async def test_a_late_retry_drops_nothing_and_undeclared_ids_drop_nothing(stub, namespace, lease):
    """#31 item 3: a retry after more than 4,096 other releases was applied again.
    A spent id, or one no pinned Lookup declared, now drops nothing; a release
    without ids keeps releasing by hash."""
    ns = namespace.id
    chain = await store(stub, ns, lease, list(range(1, 1 + 3 * BLOCK_SIZE)))
    other = await store(stub, ns, lease, list(range(900, 900 + BLOCK_SIZE)))
    hit = await pin(stub, ns, lease, chain, release_id=1)
    await pin(stub, ns, lease, chain, release_id=2)
    first = pb.ReleaseRequest(namespace_id=ns, lease_id=lease, packed_hashes=hit, release_ids=[1])
    assert (await stub.Release(first)).released == 3
    runs = 1000
    for round_ in range(5):  # 5,000 other hits' releases, 1,000 a call
        one = await pin(stub, ns, lease, other, release_id=100)  # one pin set a run...
        ids = [10_000 * (round_ + 1) + i for i in range(runs)]
        ids[0] = 100  # ...the rest name nothing: they drop nothing
        resp = await stub.Release(
            pb.ReleaseRequest(
                namespace_id=ns,
                lease_id=lease,
                packed_hashes=one * runs,
                runs=[1] * runs,
                release_ids=ids,
            )
        )
        assert resp.released == 1
    assert (await stub.Release(first)).released == 3  # spent: its first answer, nothing dropped
    assert await pinned(stub) == 3  # the second hit's pins hold
    assert (
        await stub.Release(pb.ReleaseRequest(namespace_id=ns, lease_id=lease, packed_hashes=hit))
    ).released == 3
    assert await pinned(stub) == 0


async def test_a_release_id_names_one_live_pinned_lookup(stub, namespace, lease):
    ns = namespace.id
    chain = await store(stub, ns, lease, list(range(1, 1 + 2 * BLOCK_SIZE)))
    hit = await pin(stub, ns, lease, chain, release_id=5)
    for request in (
        pb.LookupRequest(
            namespace_id=ns, lease_id=lease, pin=True, packed_hashes=b"".join(chain), release_id=5
        ),
        pb.LookupRequest(namespace_id=ns, packed_hashes=b"".join(chain), release_id=6),  # no pin
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Lookup(request)
        assert err.value.code() == INVALID and field_of(err.value) == "release_id"
    assert await pinned(stub) == 2
    release = pb.ReleaseRequest(namespace_id=ns, lease_id=lease, packed_hashes=hit, release_ids=[5])
    assert (await stub.Release(release)).released == 2
    assert await pin(stub, ns, lease, chain, release_id=5) == hit  # spent: free to name anew
    assert (await stub.Release(release)).released == 2
    assert await pinned(stub) == 0
