"""LMCache MP-mode side of `bench_lmcache`: STORE/RETRIEVE through ``lmcache server``.

Runs under LMCache's Python (its own venv), imports nothing from kvstore.
`bench_lmcache` starts the MP server (``lmcache server --supported-transfer-mode
auto ...``, ZMQ on a port, chunks of 256 tokens) and runs

    LMCACHE_PYTHON benchmarks/_lmcache_mp_client.py '<json args>'

The client is LMCache's own (``lmcache bench server``'s `ServerBenchClient`,
in its CPU mode): one simulated vLLM worker whose paged KV cache is
``layers`` CPU tensors of ``(2, blocks, block_size, heads, head_dim)``,
registered with the server. ``transfer_mode``:

* ``lmcache_driven``: REGISTER_KV_CACHE moves the KV cache tensors into POSIX
  shared memory; on STORE/RETRIEVE the server copies between them and its L1
  memory itself (the CUDA-IPC path's CPU twin).
* ``engine_driven``: the worker gathers the blocks into shared-memory slots the
  server hands out (PREPARE), then COMMITs; RETRIEVE scatters them back.

The KV cache is filled with the benchmark's bytes (the blocks file, in order,
layer after layer). Per repeat, a new token sequence (a cold store):
store = STORE of all full chunks (its reply; the STORE can answer before a
LOOKUP sees every chunk, so the time until one does, polling with fresh
sessions, is reported apart as ``store_until_lookup_sees_it``); load = a new
session's LOOKUP (which locks and prefetches the chunks) then RETRIEVE of the
hit, into the zeroed KV cache, checked equal to the stored bytes. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import torch
from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
from lmcache.cli.commands.bench.server_bench.config import BenchConfig


def run(args: dict[str, Any]) -> dict[str, Any]:
    n, tokens_per_block = args["blocks"], args["tokens"]
    heads, head_dim, layers = args["heads"], args["head_dim"], args["layers"]
    config = BenchConfig(
        rpc_url=f"tcp://127.0.0.1:{args['port']}",
        http_url=f"http://127.0.0.1:{args['http_port']}",
        mode="cpu",
        transfer_mode=args["transfer_mode"],
        tp_size=1,
        use_mla=False,
        num_tokens=n * tokens_per_block,
        kvcache_shape_spec=f"(2,{n},{tokens_per_block},{heads},{head_dim}):float16:{layers}",
        num_blocks=n,
        block_size=tokens_per_block,
    )
    client = ServerBenchClient(config, log=lambda _line: None)
    client.start()
    try:
        caches = list(client._workers[0].kv_caches.values())  # the simulated worker's KV cache
        src = torch.from_numpy(np.fromfile(args["data"], dtype=np.uint8))
        flat = [c.view(-1).view(torch.uint8) for c in caches]
        if sum(f.numel() for f in flat) != src.numel():
            raise RuntimeError("the KV cache and the blocks file differ in size")
        offset = 0
        for f in flat:
            f.copy_(src[offset : offset + f.numel()])
            offset += f.numel()
        stored = [f.clone() for f in flat]  # bytes: random fp16 holds NaNs, never equal
        runs = []
        for rep in range(args["repeats"] + 1):  # rep 0 warms up
            request = client.create_request(rep, f"store-{rep}", "cold")
            if request is None or request.num_full_tokens != n * tokens_per_block:
                raise RuntimeError("the request does not cover every block in full chunks")
            t0 = time.perf_counter()
            store = client.store(request, 0, request.num_full_tokens)
            t1 = time.perf_counter()
            client.end_session(request)
            if store is None or not store.succeeded:
                raise RuntimeError(f"LMCache STORE failed: {store}")
            # The STORE reply can come before a LOOKUP sees every chunk: poll (fresh
            # sessions) until one does; the wait is reported apart, not in ``store``.
            deadline = time.monotonic() + 30
            probe = 0
            while True:
                probe += 1
                look = client.create_request(rep, f"probe-{rep}-{probe}", "warm")
                assert look is not None
                full = client.lookup(look).hit_chunks * look.chunk_size == look.num_full_tokens
                client.end_session(look)
                if full:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the stored chunks never became visible to LOOKUP")
            t_visible = time.perf_counter()
            for c in caches:
                c.zero_()
            again = client.create_request(rep, f"load-{rep}", "warm")
            assert again is not None
            t2 = time.perf_counter()
            lookup = client.lookup(again)
            t3 = time.perf_counter()
            if lookup.hit_chunks * again.chunk_size != again.num_full_tokens:
                raise RuntimeError(f"LMCache LOOKUP hit {lookup.hit_chunks} chunks, not all")
            loaded = client.retrieve(again, 0, again.num_full_tokens)
            t4 = time.perf_counter()
            client.end_session(again)
            if loaded is None or not loaded.succeeded:
                raise RuntimeError(f"LMCache RETRIEVE failed: {loaded}")
            if not all(torch.equal(a, b) for a, b in zip(stored, flat, strict=True)):
                raise RuntimeError("LMCache retrieved other bytes than it stored")
            if rep:
                runs.append(
                    {
                        "store": t1 - t0,
                        "store_until_lookup_sees_it": t_visible - t0,
                        "load": t4 - t2,
                        "load_lookup": t3 - t2,
                        "load_retrieve": t4 - t3,
                    }
                )
        return {"runs": runs, "chunk_tokens": again.chunk_size, "verified": True}
    finally:
        client.close()


def main() -> None:
    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    result = run(args)
    print("LMCACHE_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
