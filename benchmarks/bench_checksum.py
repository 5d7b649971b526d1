"""Checksum benchmark: xxh3-64 of block-sized buffers vs a numpy copy of the same bytes.

Every store hashes the blocks it wrote and every peer fetch (and, with
``verify_checksums = "all"``, every load) hashes the blocks it copied
(`kvstore.checksum`). That costs a read of the bytes; the copy it rides on
costs a read and a write. Measured here, no server: `block_checksums` over
``--total-mib`` of buffers cut into blocks of each ``--block-kib`` size,
against a numpy copy of the same blocks into a second array (the baseline,
in the same run, block by block as the SDK copies). The goal is a checksum
at least twice as fast as that copy (``ratio`` >= 2).

    python -m benchmarks.bench_checksum [--block-kib 64,256,2048] [--total-mib 256]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import xxhash

from kvstore.checksum import block_checksums
from kvstore.cli.microbench import best_of


def run(block_kib: list[int], total_mib: int, repeat: int) -> dict[str, Any]:
    total = total_mib << 20
    src_all = np.random.default_rng(0).integers(0, 256, size=total, dtype=np.uint8)
    dst_all = np.ones(total, dtype=np.uint8)  # faulted in before timing
    sizes = []
    for kib in block_kib:
        block = kib << 10
        n = total // block
        src = list(src_all[: n * block].reshape(n, block))  # views, no copies
        dst = list(dst_all[: n * block].reshape(n, block))
        nbytes = n * block

        def copy(src: list[Any] = src, dst: list[Any] = dst) -> None:
            for s, d in zip(src, dst, strict=True):
                np.copyto(d, s)

        expected = [xxhash.xxh3_64_intdigest(s.tobytes()) or 1 for s in src[:4]]
        if list(block_checksums(src[:4])) != expected:
            raise RuntimeError("block_checksums differs from xxhash's own digest")
        t_copy = best_of(copy, repeat)
        t_sum = best_of(lambda src=src: block_checksums(src), repeat)
        sizes.append(
            {
                "block_bytes": block,
                "blocks": n,
                "gbps": {
                    "xxh3_64": round(nbytes / t_sum / 1e9, 2),
                    "numpy_copy": round(nbytes / t_copy / 1e9, 2),
                },
                "us_per_block": {
                    "xxh3_64": round(t_sum / n * 1e6, 2),
                    "numpy_copy": round(t_copy / n * 1e6, 2),
                },
                "ratio": round(t_copy / t_sum, 2),
            }
        )
    return {
        "benchmark": "checksum",
        "algorithm": "xxh3_64",
        "xxhash": xxhash.VERSION,
        "xxhash_c": xxhash.XXHASH_VERSION,
        "total_bytes": total,
        "sizes": sizes,
        "goal": "ratio >= 2 (checksum at least twice the speed of the copy)",
        "met": all(s["ratio"] >= 2 for s in sizes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--block-kib", default="64,256,2048", help="block sizes, comma-separated")
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.total_mib, args.repeat = 8, 2
    kib = [int(k) for k in args.block_kib.split(",")]
    print(json.dumps(run(kib, args.total_mib, args.repeat), indent=2))


if __name__ == "__main__":
    main()
