"""A model-runner process for the integration tests: one prefill through kvstore.

    python -m tests.integrations.runner --target HOST:PORT --prompt-file p.json --out l.pt

Builds the tiny random Llama of `tiny_llama` (same seed, same weights in every
process), runs `CachedPrefill.prefill` on the prompt, saves the tail's logits
with `torch.save` and prints one JSON line with the counts. A namespace the
node refuses prints ``{"error": "<class name>", ...}`` and exits 3.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvstore.client import SyncClient
from kvstore.errors import AlreadyExists
from kvstore.integrations.transformers import CachedPrefill

BLOCK_SIZE = 16
"""Tokens per block in these tests."""


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = 64) -> LlamaForCausalLM:
    """A small Llama with seeded random weights, float32, built offline from a config."""
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True)
    parser.add_argument("--tenant", default="acme")
    parser.add_argument("--model-id", default="tiny-llama")
    parser.add_argument("--fingerprint", default="config", choices=["config", "weights", "none"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompt-file", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    tokens = json.loads(args.prompt_file.read_text())
    model = tiny_llama(args.seed, args.layers)
    with SyncClient(args.target, tenant=args.tenant, timeout=10.0) as kv:
        try:
            runner = CachedPrefill(
                kv, model, args.model_id, block_size=BLOCK_SIZE, fingerprint=args.fingerprint
            )
        except AlreadyExists as exc:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
            return 3
        result = runner.prefill(tokens)
    torch.save(result.logits, args.out)
    summary = {
        "namespace": runner.namespace.id,
        "hit_tokens": result.hit_tokens,
        "reused_tokens": result.reused_tokens,
        "computed_tokens": result.computed_tokens,
        "stored_blocks": result.stored_blocks,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
