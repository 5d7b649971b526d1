"""Tiny random checkpoints for vLLM, made offline (no downloads): Llama, and one model
of each family `FAMILIES` names (sliding windows, hybrids, MLA).

A config, seeded random weights (safetensors) and a word-level tokenizer
built with `tokenizers` are written to a folder that ``LLM(model=folder)``
loads. The same seed gives the same weights in every process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **_shared(hidden, layers, max_positions),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    _save_tokenizer(folder)
    return folder


def _save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over `VOCAB` ids (``w3`` ... ``w1023``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

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


FAMILIES = ("llama", "gemma3", "sliding", "mla")
"""The model families `make_model` writes: full attention (Llama), a Gemma-3-style hybrid
(sliding-window and global layers: two KV cache groups), a Mistral-style model whose every
layer has a sliding window, and a DeepSeek-V2-style model with MLA."""


def make_model(family: str, folder: Path, *, seed: int = 0, **size: int) -> Path:
    """A tiny random checkpoint of ``family`` (one of `FAMILIES`) in ``folder``; ``size``:
    ``layers``, ``hidden`` and ``max_positions`` where the defaults are too small (the
    benchmark's)."""
    makers = {"llama": make_llama, "gemma3": make_gemma3, "sliding": make_sliding, "mla": make_mla}
    if family not in makers:
        raise ValueError(f"unknown model family {family!r}; one of {FAMILIES}")
    return makers[family](folder, seed=seed, **size)  # type: ignore[operator]


SLIDING_WINDOW = 64
"""Tokens in the sliding window of the `gemma3` and `sliding` models (two 32-token blocks)."""


def make_gemma3(
    folder: Path,
    *,
    seed: int = 0,
    layers: int = 3,
    hidden: int = 128,
    max_positions: int = 2048,
) -> Path:
    """A Gemma-3-style text model: layers 0 and 1 slide over `SLIDING_WINDOW` tokens,
    layer 2 attends globally (vLLM: two KV cache groups with the hybrid manager on)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        num_attention_heads=hidden // 32,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=SLIDING_WINDOW,
        # Gemma 3's pattern, five sliding layers to one global, ending on a global one.
        layer_types=[
            "full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention"
            for i in range(layers)
        ],
        **_shared(hidden, layers, max_positions),
    )
    return _save(Gemma3ForCausalLM, config, folder, seed)


def make_sliding(
    folder: Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 128,
    max_positions: int = 2048,
) -> Path:
    """A Mistral-style model whose every layer slides over `SLIDING_WINDOW` tokens."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        num_attention_heads=hidden // 32,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=SLIDING_WINDOW,
        **_shared(hidden, layers, max_positions),
    )
    return _save(MistralForCausalLM, config, folder, seed)


def make_mla(
    folder: Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 128,
    max_positions: int = 2048,
) -> Path:
    """A DeepSeek-V2-style dense model with MLA (``kv_lora_rank`` 512, ``qk_rope_head_dim``
    64: the 576-wide latent vLLM's CPU MLA kernel takes)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        first_k_dense_replace=layers,  # every layer dense: no experts
        n_routed_experts=1,
        **_shared(hidden, layers, max_positions),
    )
    return _save(DeepseekV2ForCausalLM, config, folder, seed)


def _shared(hidden: int, layers: int, max_positions: int) -> dict[str, Any]:
    """The config fields every tiny model shares (float32, the word tokenizer's ids)."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "max_position_embeddings": max_positions,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _save(model_class: Any, config: Any, folder: Path, seed: int) -> Path:
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model_class(config).eval().save_pretrained(folder, safe_serialization=True)
    _save_tokenizer(folder)
    return folder


if __name__ == "__main__":
    import sys

    make_model(sys.argv[2] if len(sys.argv) > 2 else "llama", Path(sys.argv[1]))
