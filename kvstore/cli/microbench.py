"""The benchmarks that ``kvstore bench`` runs by itself: the core, in this process.

They need only the installed package (numpy and the pure core): no
repository checkout, no ``benchmarks/`` package, no torch, no GPU, no node.
Each returns plain numbers; a baseline is measured in the same run where
one makes sense (a naive ``sha256(pickle.dumps(...))`` loop for hashing).
The repository's ``benchmarks/bench_core.py`` runs these same functions at
full size (a million resident blocks) for the README's figures.
"""

from __future__ import annotations

import gc
import hashlib
import pickle
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstore.hashing import HashScheme, hash_blocks, kvstore_root, vllm_root
from kvstore.layout import KVLayout, NamespaceSpec
from kvstore.store import Store
from kvstore.types import BlockHash, LeaseId, TenantId

BLOCK = 16
SPEC = NamespaceSpec("kvstore-bench", KVLayout(32, 8, 128, BLOCK, "bfloat16"))
TENANT = TenantId("bench")
CHAIN = 512
"""Blocks per looked-up chain (8k tokens at 16 tokens a block)."""


@dataclass(frozen=True, slots=True)
class Sizes:
    """How much work each benchmark does."""

    tokens: int
    resident: int
    metadata_blocks: int


QUICK = Sizes(tokens=8192, resident=10_000, metadata_blocks=10_000)
FULL = Sizes(tokens=131_072, resident=200_000, metadata_blocks=100_000)


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
        block = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
        parent = hashlib.sha256(pickle.dumps((parent, block, None))).digest()
        out.append(parent)
    return out


def cbor2_hashes(root: bytes, tokens: list[int]) -> list[bytes]:
    """vLLM's own construction: ``sha256(cbor2.dumps((parent, tokens, None), canonical=True))``."""
    import cbor2  # a dev dependency only: `hashing` skips this row without it

    parent, out = root, []
    for i in range(len(tokens) // BLOCK):
        block = tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
        parent = hashlib.sha256(cbor2.dumps((parent, block, None), canonical=True)).digest()
        out.append(parent)
    return out


def _has_cbor2() -> bool:
    try:
        import cbor2  # noqa: F401
    except ImportError:
        return False
    return True


def hashing(sizes: Sizes) -> dict[str, float]:
    """Chained prefix hashes per second: ours, vLLM's scheme, and naive/cbor2 baselines.

    The vLLM scheme is timed against cbor2 + hashlib (what vLLM itself runs)
    when cbor2 is installed; the row is left out otherwise.
    """
    arr = np.random.default_rng(0).integers(0, 128_000, size=sizes.tokens, dtype=np.int64)
    tokens = arr.tolist()
    root = kvstore_root(SPEC.digest(), b"salt")
    ours = best_of(lambda: hash_blocks(root, arr, BLOCK))
    ours_list = best_of(lambda: hash_blocks(root, tokens, BLOCK))
    vroot = vllm_root("0")
    vllm = best_of(lambda: hash_blocks(vroot, tokens, BLOCK, scheme=HashScheme.VLLM_SHA256_CBOR))
    vllm_array = best_of(lambda: hash_blocks(vroot, arr, BLOCK, scheme=HashScheme.VLLM_SHA256_CBOR))
    naive = best_of(lambda: naive_hashes(root, tokens))
    reference: dict[str, float] = {}
    if _has_cbor2():
        cbor2_time = best_of(lambda: cbor2_hashes(vroot, tokens))
        reference = {
            "vllm_cbor2_hashlib_tokens_per_s": sizes.tokens / cbor2_time,
            "vllm_speedup_vs_cbor2": cbor2_time / vllm,
        }
    return {
        "tokens": sizes.tokens,
        "kvstore_sha256_tokens_per_s": sizes.tokens / ours,
        "kvstore_sha256_from_list_tokens_per_s": sizes.tokens / ours_list,
        "vllm_sha256_cbor_tokens_per_s": sizes.tokens / vllm,
        "vllm_sha256_cbor_from_array_tokens_per_s": sizes.tokens / vllm_array,
        **reference,
        "naive_pickle_sha256_tokens_per_s": sizes.tokens / naive,
        "speedup_vs_naive": naive / ours,
        "ms_per_128k_tokens": ours * 1e3 * 131072 / sizes.tokens,
    }


def fill(store: Store, resident: int) -> list[BlockHash]:
    """Store ``resident`` blocks as unshared chains of `CHAIN`; return the first chain."""
    lease = LeaseId(1)
    store.open_lease(lease, TENANT, 3600.0, 0.0)
    root = kvstore_root(SPEC.digest(), b"salt")
    first: list[BlockHash] = []
    done, chain = 0, 0
    while done < resident:
        n = min(CHAIN, resident - done)
        tokens = np.arange(n * BLOCK, dtype=np.int64)
        tokens[0] = chain  # a distinct first token per chain: no sharing
        hashes = hash_blocks(root, tokens, BLOCK)
        store.reserve(SPEC.namespace_id, TENANT, lease, hashes, 1.0)
        store.commit(SPEC.namespace_id, TENANT, lease, hashes, 1.0)
        first = first or hashes
        done, chain = done + n, chain + 1
    return first


def lookup(sizes: Sizes) -> dict[str, float]:
    """Cost of looking up (and of pinning and releasing) a 512-block chain.

    The baseline, measured in the same run on the same hashes, is a loop of
    512 ``dict.get`` calls: the per-block figures are meant to be read as a
    multiple of it.
    """
    store = Store()
    store.register_namespace(SPEC, capacity=sizes.resident + CHAIN)
    gc.collect()
    chain = fill(store, max(sizes.resident, CHAIN))
    ns = SPEC.namespace_id
    lease = LeaseId(2)
    store.open_lease(lease, TENANT, 3600.0, 0.0)
    rounds = 200
    index = {h: i for i, h in enumerate(chain)}

    def dict_gets() -> None:
        get = index.get
        for _ in range(rounds):
            for h in chain:
                get(h)

    def plain_lookups() -> None:
        for _ in range(rounds):
            store.lookup(ns, TENANT, chain, 2.0)

    def pin_release() -> None:
        for _ in range(rounds):
            store.lookup(ns, TENANT, chain, 2.0, lease_id=lease)
            store.release(ns, TENANT, lease, chain, 2.0)

    per_block = 1e9 / (rounds * len(chain))
    dict_ns = best_of(dict_gets, 3) * per_block
    plain_ns = best_of(plain_lookups, 3) * per_block
    pinned_ns = best_of(pin_release, 3) * per_block
    return {
        "resident_blocks": max(sizes.resident, CHAIN),
        "lookup_512_us": plain_ns * len(chain) / 1e3,
        "lookup_pin_plus_release_512_us": pinned_ns * len(chain) / 1e3,
        "dict_get_ns_per_block": dict_ns,
        "lookup_ns_per_block": plain_ns,
        "pin_plus_release_ns_per_block": pinned_ns,
        "pin_plus_release_vs_dict_get": pinned_ns / dict_ns,
    }


def metadata(sizes: Sizes) -> dict[str, float]:
    """Python heap bytes the store spends per resident block."""
    store = Store()
    store.register_namespace(SPEC, capacity=sizes.metadata_blocks)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        fill(store, sizes.metadata_blocks)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return {
        "blocks": sizes.metadata_blocks,
        "metadata_bytes_per_block": (after - before) / sizes.metadata_blocks,
    }


BENCHMARKS: dict[str, Callable[[Sizes], dict[str, float]]] = {
    "hashing": hashing,
    "lookup": lookup,
    "metadata": metadata,
}
"""The built-in benchmarks by name, in the order ``kvstore bench`` runs them."""
