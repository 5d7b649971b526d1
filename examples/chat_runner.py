"""A chat model runner that skips prefill for cached prefixes (kvstore + transformers).

    pip install ".[hf]"   # torch + transformers (a CPU-only torch: see the README)
    python examples/chat_runner.py --target 127.0.0.1:50051 --requests 60

Serves a synthetic chat workload: several tenants, a few shared system
prompts, many distinct user prompts. Every request is run twice, back to
back: once with a plain forward pass (the no-cache baseline) and once
through `CachedPrefill`, which reuses the tenant's cached blocks from the
node and stores the new ones. It checks that both give the same logits and
prints one JSON summary: hit rate in tokens, prefill tokens saved and the
mean time per request with and without the cache.

Without ``--model`` it builds a small Llama with seeded random weights from a
config (offline, no download); ``--model DIR`` loads a local Hugging Face
model directory instead. Prompts are random token ids either way (the
workload's shape is what matters, not its text). The target may also come
from ``KVSTORE_TARGET`` (docker-compose); the runner waits for the node to
answer for up to ``--wait`` seconds. Exits 0 on success, 1 when the cached
logits differ from the baseline.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

try:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel
except ImportError as exc:  # a plain `pip install .` has neither
    sys.exit(
        f"chat_runner needs the hf extra (torch, transformers): pip install 'kvstore[hf]' ({exc})"
    )

from kvstore.client import SyncClient
from kvstore.errors import KVStoreError
from kvstore.integrations.transformers import CachedPrefill, Fingerprint, cache_argument

log = logging.getLogger("chat_runner")


@dataclass(frozen=True, slots=True)
class Request:
    """One chat turn: a tenant's system prompt followed by a user prompt."""

    tenant: str
    system: int
    tokens: list[int]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (every flag has a default; the target may come from the env)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default=os.environ.get("KVSTORE_TARGET", "127.0.0.1:50051"))
    p.add_argument("--requests", type=int, default=60, help="requests to serve")
    p.add_argument("--tenants", type=int, default=3)
    p.add_argument("--system-prompts", type=int, default=3, help="shared system prompts")
    p.add_argument("--system-tokens", type=int, default=512, help="tokens per system prompt")
    p.add_argument("--user-tokens", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    p.add_argument("--max-new-tokens", type=int, default=8, help="greedy tokens per reply")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--capacity-bytes", type=int, default=0, help="pool to ask for (0: node's)")
    p.add_argument("--model", help="a local Hugging Face model directory (default: random)")
    p.add_argument("--model-id", help="names the exact weights (default: derived)")
    p.add_argument("--layers", type=int, default=4, help="random model: layers")
    p.add_argument("--hidden", type=int, default=256, help="random model: hidden size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the node")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max |logit diff| allowed")
    return p.parse_args(argv)


def random_llama(layers: int, hidden: int, seed: int) -> PreTrainedModel:
    """A Llama with seeded random weights (float32), built offline from a config."""
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=4096,
    )
    torch.manual_seed(seed)
    model: PreTrainedModel = LlamaForCausalLM(config)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def make_workload(args: argparse.Namespace, vocab: int) -> list[Request]:
    """Requests of ``--tenants`` tenants over ``--system-prompts`` system prompts."""
    rng = random.Random(args.seed)
    systems = [
        [rng.randrange(vocab) for _ in range(args.system_tokens)]
        for _ in range(args.system_prompts)
    ]
    low, high = args.user_tokens
    requests = []
    for _ in range(args.requests):
        system = rng.randrange(len(systems))
        user = [rng.randrange(vocab) for _ in range(rng.randint(low, high))]
        requests.append(
            Request(f"tenant-{rng.randrange(args.tenants)}", system, systems[system] + user)
        )
    return requests


def wait_for_node(target: str, seconds: float) -> None:
    """Ping the node until it answers (a compose stack starts it alongside the runner)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with SyncClient(target, timeout=2.0) as kv:
                kv.ping()
            return
        except KVStoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def decode(model: PreTrainedModel, cache: Any, logits: torch.Tensor, steps: int) -> list[int]:
    """Greedy decoding of ``steps`` tokens from a prefilled cache."""
    out: list[int] = []
    kwarg = cache_argument(model)
    for _ in range(steps):
        token = int(logits[-1].argmax())
        out.append(token)
        ids = torch.tensor([[token]], device=model.device)
        with torch.no_grad():
            logits = model(
                input_ids=ids, **{kwarg: cache}, use_cache=True, logits_to_keep=1
            ).logits[0]
    return out


def serve_baseline(
    model: PreTrainedModel, req: Request, steps: int
) -> tuple[torch.Tensor, float, float]:
    """Full prefill and decode without kvstore.

    Returns:
        The last prompt position's logits, seconds of the prefill and of the request.
    """
    start = time.perf_counter()
    ids = torch.tensor([req.tokens], device=model.device)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    prefilled = time.perf_counter()
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    decode(model, cache, out.logits[0], steps)
    return out.logits[0, -1], prefilled - start, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Run the workload with and without the cache; print the JSON summary."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    model: PreTrainedModel
    fingerprint: Fingerprint
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
        model.eval()  # type: ignore[no-untyped-call]
        model_id, fingerprint = args.model_id or os.path.abspath(args.model), "config"
    else:
        model = random_llama(args.layers, args.hidden, args.seed)
        model_id = args.model_id or f"random-llama-{args.layers}x{args.hidden}-seed{args.seed}"
        fingerprint = "weights"  # cheap for a small model, and exact
    requests = make_workload(args, model.config.get_text_config().vocab_size)
    wait_for_node(args.target, args.wait)
    serve_baseline(model, requests[0], 1)  # warm-up: first-call costs would skew the baseline

    clients: dict[str, SyncClient] = {}
    runners: dict[str, CachedPrefill] = {}
    totals = {"prompt": 0, "hit": 0, "reused": 0, "computed": 0, "stored": 0}
    times: dict[str, list[float]] = {k: [] for k in ("no_cache", "cache", "prefill_no_cache")}
    times["prefill_cache"] = []
    worst = 0.0
    try:
        for req in requests:
            if req.tenant not in runners:
                clients[req.tenant] = SyncClient(args.target, tenant=req.tenant)
                runners[req.tenant] = CachedPrefill(
                    clients[req.tenant],
                    model,
                    model_id,
                    block_size=args.block_size,
                    fingerprint=fingerprint,
                    capacity_bytes=args.capacity_bytes,
                )
            expected, prefill_s, request_s = serve_baseline(model, req, args.max_new_tokens)
            times["prefill_no_cache"].append(prefill_s)
            times["no_cache"].append(request_s)
            start = time.perf_counter()
            result = runners[req.tenant].prefill(req.tokens, logits_to_keep=1)
            times["prefill_cache"].append(time.perf_counter() - start)
            decode(model, result.cache, result.logits, args.max_new_tokens)
            times["cache"].append(time.perf_counter() - start)
            worst = max(worst, float((result.logits[-1] - expected).abs().max()))
            totals["prompt"] += result.prompt_tokens
            totals["hit"] += result.hit_tokens
            totals["reused"] += result.reused_tokens
            totals["computed"] += result.computed_tokens
            totals["stored"] += result.stored_blocks
    finally:
        for client in clients.values():
            client.close()

    mean_ms = {k: round(1000 * statistics.fmean(v), 2) for k, v in times.items()}
    p50_ms = {k: round(1000 * statistics.median(v), 2) for k, v in times.items()}
    summary = {
        "target": args.target,
        "model": model_id,
        "layers": model.config.num_hidden_layers,
        "hidden": model.config.hidden_size,
        "requests": len(requests),
        "tenants": args.tenants,
        "system_prompts": args.system_prompts,
        "system_tokens": args.system_tokens,
        "prompt_tokens": totals["prompt"],
        "hit_tokens": totals["hit"],
        "hit_rate_tokens": round(totals["hit"] / totals["prompt"], 4),
        "prefill_tokens_saved": totals["reused"],
        "prefill_tokens_computed": totals["computed"],
        "blocks_stored": totals["stored"],
        "max_new_tokens": args.max_new_tokens,
        "mean_request_ms_no_cache": mean_ms["no_cache"],
        "mean_request_ms_cache": mean_ms["cache"],
        "mean_prefill_ms_no_cache": mean_ms["prefill_no_cache"],
        "mean_prefill_ms_cache": mean_ms["prefill_cache"],
        "p50_prefill_ms_no_cache": p50_ms["prefill_no_cache"],
        "p50_prefill_ms_cache": p50_ms["prefill_cache"],
        "speedup_request": round(mean_ms["no_cache"] / mean_ms["cache"], 2),
        "speedup_prefill": round(mean_ms["prefill_no_cache"] / mean_ms["prefill_cache"], 2),
        "max_abs_logit_diff": worst,
        "logits_match": worst <= args.tolerance,
    }
    print(json.dumps(summary, indent=2), flush=True)
    return 0 if summary["logits_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
