"""Copy benchmark: the SDK's copies into and out of a host pool vs a numpy copy, no server.

The copy halves of `Client.store` (`kvstore.client.transfer._copy_in`) and
of a load (`Hit.numpy_views` block by block, and `Hit.copy_into`), on a real
pool file mapped by a `HostMapping` as a runner maps it, against a plain
numpy copy of the same bytes, block by block, between two arrays of this
process (the baseline, measured in the same run). The pool's
``huge_page_bytes`` and whether its directory offers huge pages are
reported: point ``--shm-dir`` at a tmpfs mounted ``huge=within_size`` to
compare (``docs/pools.md``). The RPC halves are `bench_service`'s.

    python -m benchmarks.bench_copy [--blocks 512] [--block-kib 256] [--shm-dir /dev/shm]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

import numpy as np

from kvstore.cli.microbench import best_of
from kvstore.client.hit import BlockLocation, Hit
from kvstore.client.replies import reservation_from_proto
from kvstore.client.transfer import _copy_in
from kvstore.layout import KVLayout
from kvstore.pool import HostMapping, HostPool, host_pages
from kvstore.results import MissReason
from kvstore.stamps import stamp_ident
from kvstore.types import BlockHash, NamespaceId, SlotId
from kvstore.v1 import kvstore_pb2 as pb


class _Ns:
    def __init__(self, mapping: HostMapping, layout: KVLayout) -> None:
        self.mapping = mapping
        self.layout = layout
        self.verify_loads = True  # the node default (verify_checksums = "all")


def run(blocks: int, block_kib: int, shm_dir: str, repeat: int) -> dict[str, Any]:
    layout = KVLayout(1, 1, block_kib * 1024 // 64, 16, "float16")  # 2*16*head_dim*2 bytes
    bb = layout.block_bytes
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-copy-", dir=shm_dir) as directory:
        pool = HostPool.create(
            NamespaceId("00000000b0c0b0c0"),
            bb,
            blocks,
            1,
            directory=directory,
            arena_bytes=bb * blocks,
        )
        mapping = HostMapping.open(pool.descriptor)
        for slot in range(blocks):  # READY at generation 1, as a commit stamps it; copy_into checks
            pool.stamp(SlotId(slot), 1, stamp_ident(bytes(32)))
        try:
            src_all = np.random.default_rng(0).integers(0, 256, size=(blocks, bb), dtype=np.uint8)
            dst_all = np.ones((blocks, bb), dtype=np.uint8)  # faulted in
            src, dst = list(src_all), list(dst_all)
            ns = _Ns(mapping, layout)
            reserved = reservation_from_proto(
                pb.ReserveResponse(
                    hashes=bytes(32 * blocks),
                    statuses=[pb.RESERVE_STATUS_RESERVED] * blocks,
                    slots=range(blocks),
                    generations=[1] * blocks,
                    slots_per_arena=pool.descriptor.slots_per_arena,
                    block_bytes=bb,
                )
            )
            hit = Hit.of_locations(
                ns,  # type: ignore[arg-type]
                tuple(
                    BlockLocation(BlockHash(bytes(32)), SlotId(i), 1, 0, i * bb)
                    for i in range(blocks)
                ),
                hit_tokens=0,
                query_tokens=0,
                pinned=True,  # as a pinned lookup's (views need a pin); the pool is this
                miss_reason=MissReason.NONE,  # benchmark's own: nothing reuses its slots
                epoch=1,
                mapping=mapping,
            )

            def numpy_copy() -> None:
                for target, block in zip(dst, src, strict=True):
                    np.copyto(target, block)

            def load_views() -> None:
                for target, view in zip(dst, hit.numpy_views(), strict=True):
                    np.copyto(target, view.reshape(-1).view(np.uint8))

            timings = {
                "numpy_copy": best_of(numpy_copy, repeat),
                "store_block_list": best_of(
                    lambda: _copy_in(ns, reserved, src, lambda: None),  # type: ignore[arg-type]
                    repeat,
                ),
                "store_one_array": best_of(
                    lambda: _copy_in(ns, reserved, src_all, lambda: None),  # type: ignore[arg-type]
                    repeat,
                ),
                "load_numpy_views": best_of(load_views, repeat),
                "load_copy_into": best_of(lambda: hit.copy_into(dst_all), repeat),
            }
            if not np.array_equal(dst_all, src_all):
                raise RuntimeError("loaded bytes differ from the stored bytes")
            huge = pool.huge_page_bytes
        finally:
            mapping.close()
            pool.close()
    nbytes = blocks * bb
    base = timings["numpy_copy"]
    return {
        "benchmark": "copy",
        "blocks": blocks,
        "block_bytes": bb,
        "shm_dir": shm_dir,
        "huge_pages_offered": host_pages.support(shm_dir).reason,
        "pool_huge_page_bytes": huge,
        "gbps": {name: round(nbytes / t / 1e9, 3) for name, t in timings.items()},
        "time_over_numpy": {name: round(t / base, 3) for name, t in timings.items()},
        "us_per_block": {name: round(t / blocks * 1e6, 2) for name, t in timings.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.repeat = 64, 3
    print(json.dumps(run(args.blocks, args.block_kib, args.shm_dir, args.repeat), indent=2))


if __name__ == "__main__":
    main()
