"""Core store benchmark: hashing speed, lookup cost, metadata per block.

Prints one JSON object. Baselines are measured in the same run: a naive
per-block ``sha256(pickle.dumps(...))`` loop for hashing, 512 ``dict.get``
calls for a 512-block lookup and for its pin+release (per-block ns and
their ratio to it). ``lookup_large_vs_1k`` compares a lookup at
``--resident`` blocks with one at 1,000; metadata is tracemalloc's bytes
per resident block. The measurements
are `kvstore.cli.microbench`'s (what ``kvstore bench`` runs at small sizes);
this module runs them at full size for the README's figures.

    python -m benchmarks.bench_core [--resident 1000000] [--tokens 131072]
"""

from __future__ import annotations

import argparse
import json

from kvstore.cli.microbench import Sizes, hashing, lookup, metadata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--resident", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.resident = 8192, 10_000
    sizes = Sizes(args.tokens, args.resident, 10_000 if args.quick else 100_000)
    small, large = lookup(Sizes(args.tokens, 1000, 0)), lookup(sizes)
    result = {
        "benchmark": "core",
        "hashing": hashing(sizes),
        "lookup": [small, large],
        "lookup_large_vs_1k": large["lookup_ns_per_block"] / small["lookup_ns_per_block"],
        "pin_plus_release_large_vs_1k": (
            large["pin_plus_release_ns_per_block"] / small["pin_plus_release_ns_per_block"]
        ),
        "metadata": metadata(sizes),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
