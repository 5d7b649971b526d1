"""Core store benchmark: hashing speed, lookup cost, metadata per block.

Prints one JSON object. Baselines are measured in the same run: a naive
per-block ``sha256(pickle.dumps(...))`` loop for hashing.

    python -m benchmarks.bench_core [--resident 1000000] [--tokens 131072]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import pickle
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from kvstore import KVLayout, LeaseId, NamespaceSpec, Store, TenantId
from kvstore.hashing import HashScheme, hash_blocks, kvstore_root, vllm_root
from kvstore.types import BlockHash

BLOCK = 16
SPEC = NamespaceSpec("bench", KVLayout(32, 8, 128, BLOCK, "bfloat16"))
TENANT = TenantId("bench")


def best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    """Fastest of ``repeat`` runs, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def naive_hashes(root: bytes, tokens: list[int]) -> list[bytes]:
    """The baseline: pickle a tuple per block and SHA-256 it."""
    parent, out = root, []
    for i in range(len(tokens) // BLOCK):
        parent = hashlib.sha256(
            pickle.dumps((parent, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]), None))
        ).digest()
        out.append(parent)
    return out


def bench_hashing(n_tokens: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 128_000, size=n_tokens, dtype=np.int64)
    tokens = arr.tolist()
    root = kvstore_root(SPEC.digest(), b"salt")
    ours = best_of(lambda: hash_blocks(root, arr, BLOCK))
    ours_list = best_of(lambda: hash_blocks(root, tokens, BLOCK))
    vroot = vllm_root("0")
    vllm = best_of(lambda: hash_blocks(vroot, tokens, BLOCK, scheme=HashScheme.VLLM_SHA256_CBOR))
    naive = best_of(lambda: naive_hashes(root, tokens))
    return {
        "tokens": n_tokens,
        "kvstore_sha256_tokens_per_s": n_tokens / ours,
        "kvstore_sha256_from_list_tokens_per_s": n_tokens / ours_list,
        "vllm_sha256_cbor_tokens_per_s": n_tokens / vllm,
        "naive_pickle_sha256_tokens_per_s": n_tokens / naive,
        "speedup_vs_naive": naive / ours,
        "ms_per_128k_tokens": ours * 1e3 * 131072 / n_tokens,
    }


def fill(store: Store, resident: int, chain_len: int = 512) -> list[BlockHash]:
    """Store ``resident`` blocks as chains of ``chain_len``; return the first chain."""
    lease = LeaseId(1)
    store.open_lease(lease, TENANT, 3600.0, 0.0)
    root = kvstore_root(SPEC.digest(), b"salt")
    ns = SPEC.namespace_id
    first: list[BlockHash] = []
    done, c = 0, 0
    while done < resident:
        n = min(chain_len, resident - done)
        tokens = np.arange(n * BLOCK, dtype=np.int64)
        tokens[0] = c  # a distinct first token per chain: no sharing
        hashes = hash_blocks(root, tokens, BLOCK)
        store.reserve(ns, TENANT, lease, hashes, 1.0)
        store.commit(ns, TENANT, lease, hashes, 1.0)
        first = first or hashes
        done += n
        c += 1
    return first


def bench_lookup(resident: int) -> dict[str, float]:
    store = Store()
    store.register_namespace(SPEC, capacity=resident + 1024)
    gc.collect()
    chain = fill(store, resident)
    ns = SPEC.namespace_id
    lease = LeaseId(2)
    store.open_lease(lease, TENANT, 3600.0, 0.0)
    assert len(chain) == 512
    n = 200
    start = time.perf_counter()
    for _ in range(n):
        store.lookup(ns, TENANT, chain, 2.0)
    plain = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for _ in range(n):
        store.lookup(ns, TENANT, chain, 2.0, lease_id=lease)
        store.release(ns, TENANT, lease, chain, 2.0)
    pin_release = (time.perf_counter() - start) / n
    return {
        "resident_blocks": resident,
        "lookup_512_us": plain * 1e6,
        "lookup_pin_plus_release_512_us": pin_release * 1e6,
    }


def bench_metadata(blocks: int) -> dict[str, float]:
    store = Store()
    store.register_namespace(SPEC, capacity=blocks)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    fill(store, blocks)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"blocks": blocks, "metadata_bytes_per_block": (after - before) / blocks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--resident", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.resident = 8192, 10_000
    result = {
        "benchmark": "core",
        "hashing": bench_hashing(args.tokens),
        "lookup": [bench_lookup(1000), bench_lookup(args.resident)],
        "metadata": bench_metadata(10_000 if args.quick else 100_000),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
