"""Tiny random Llama checkpoints for vLLM, made offline (no downloads).

A config, seeded random weights (safetensors) and a word-level tokenizer
built with `tokenizers` are written to a folder that ``LLM(model=folder)``
loads. The same seed gives the same weights in every process.
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 1024
"""Token ids 0..VOCAB-1; ids 0-2 are the tokenizer's special tokens."""


def make_llama(
    folder: Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    max_positions: int = 2048,
) -> Path:
    """Write a random Llama (float32) and its tokenizer to ``folder``; returns it.

    Head size is ``hidden // heads`` and must be one vLLM's CPU attention
    supports (32, 64, 80, ...).
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<pad>",
    )
    fast.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    import sys

    make_llama(Path(sys.argv[1]))
