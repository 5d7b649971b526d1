"""What the namespace of a vLLM engine is: its model id and KV layout.

Two engines share blocks only when their namespaces are equal, so the
namespace names everything that changes the bytes of a block:

- the **weights**: ``model_id`` from the connector config when given (it must
  name the exact weights, e.g. ``org/model@revision``), else vLLM's model and
  revision, plus a fingerprint of the model's config (catches a different
  architecture behind one name);
- the **weights' numerics**: the dtype the model runs in (``--dtype``) and
  any online or checkpoint quantization (``quantization=fp8``, AWQ, ...): a
  bf16 and an fp8 engine of one checkpoint compute different KV;
- the **KV bytes**: the resolved KV dtype (``cache_dtype=auto`` resolved to
  the tensor dtype vLLM allocated) and vLLM's block size, which becomes the
  namespace's block size, plus the layout (layers, KV heads, head size);
- the **KV cache group** (`kv_groups`): a model of several groups (a
  Gemma-3-style hybrid) or of one that is not plain full attention keeps
  each group in its own namespace, ``<model id>#g<index>-<kind>[-w<window>]``
  (`KVGroup.tag`), its kind and window included;
- the **tensor-parallel shape**: with ``tensor_parallel_size`` N > 1 each
  rank holds its share of the KV heads and gets a namespace of its own,
  ``<model id>#tp-N.<rank>`` (`units.engine_units`); an MLA group, the same
  on every rank, one namespace for all of them, ``<model id>#tp-N``: engines with the same model
  and N share block by block, engines with another N never do (their
  namespaces differ; their KV also differs in rounding, the all-reduce sums
  in another order). Pipeline parallelism is refused;
- the **block order** in the pool (`block_order`): CPU engines store their
  backend's own page order (``#order-cpu``), GPU engines the canonical one
  (`kvstore.integrations.vllm.paged`), so a CPU and a GPU engine never
  read each other's bytes in the wrong order.

All of it is in the model id, not only in the layout: the node keeps one
layout per model id, so two engines that differ in any of it get two
namespaces (never a shared one, never a refused registration).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from kvstore.errors import InvalidArgument
from kvstore.integrations.vllm.paged import BlockOrder
from kvstore.layout import DTYPE_BYTES, KVLayout

_RUNTIME_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype", "_name_or_path"})


GroupKind = Literal["full", "sliding", "mla"]
"""How a KV cache group's blocks are cached: every block of the prefix (``full``:
full attention, including layers whose window vLLM folded into full attention
with its hybrid manager off), only the window's blocks loaded (``sliding``), or one
latent per token and layer, the same on every tensor-parallel rank (``mla``)."""


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One of vLLM's KV cache groups, as the connector caches it (its own namespace)."""

    index: int
    """vLLM's group index (its block ids are this group's)."""
    kind: GroupKind
    layout: KVLayout
    layer_names: tuple[str, ...]
    window: int = 0
    """``sliding``: the window in tokens (vLLM keeps only the blocks it covers)."""

    @property
    def tag(self) -> str:
        """What the group adds to the namespace's model id (its kind, window and index)."""
        window = f"-w{self.window}" if self.window else ""
        return f"#g{self.index}-{self.kind}{window}"

    def first_needed_block(self, tokens: int) -> int:
        """The first block vLLM keeps for this group once ``tokens`` are computed (the
        ones before it are vLLM's null blocks): 0 but for a sliding window."""
        if self.kind != "sliding":
            return 0
        return max(0, tokens - self.window + 1) // self.layout.block_size


def kv_groups(kv_cache_config: Any) -> list[KVGroup]:
    """The KV cache groups of an engine, each with its kvstore layout and layer names.

    Raises:
        InvalidArgument: a group kind the connector cannot cache (the message names
            it and why), groups of different block sizes, or a dtype kvstore cannot
            store.
    """
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise InvalidArgument("the kvstore connector got no KV cache groups from vLLM")
    out = [_group(i, g.kv_cache_spec, list(g.layer_names)) for i, g in enumerate(groups)]
    sizes = {group.layout.block_size for group in out}
    if len(sizes) != 1:
        raise InvalidArgument(
            f"the kvstore connector needs one block size for every KV cache group; this "
            f"model's groups have {sorted(sizes)} tokens per block"
        )
    return out


def _group(index: int, spec: Any, names: list[str]) -> KVGroup:
    kind_name = type(spec).__name__
    if kind_name == "UniformTypeKVCacheSpecs":
        raise InvalidArgument(
            "the kvstore connector cannot cache a KV cache group whose layers have "
            "different shapes (UniformTypeKVCacheSpecs)"
        )
    if "Mamba" in kind_name or kind_name in ("ShortConvSpec", "LinearAttentionSpec"):
        raise InvalidArgument(
            f"the kvstore connector cannot cache this model: KV cache group {index} is "
            f"{kind_name} (Mamba or linear-attention state); kvstore stores attention KV "
            "only. Run the engine without the connector (vLLM's own prefix caching "
            'keeps its state), see docs/vllm.md "Model families"'
        )
    if kind_name in ("CrossAttentionSpec", "EncoderOnlyAttentionSpec"):
        raise InvalidArgument(
            f"the kvstore connector cannot cache KV cache group {index} ({kind_name}): "
            "its KV comes from the encoder input, not from the prompt's tokens"
        )
    if kind_name not in ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec"):
        raise InvalidArgument(
            f"the kvstore connector does not know how vLLM keeps the blocks of KV cache "
            f"group {index} ({kind_name}); supported: full attention, sliding window, MLA"
        )
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise InvalidArgument(f"KV of dtype {dtype} cannot be stored in kvstore")
    block_size = int(spec.block_size)
    if kind_name == "MLAAttentionSpec":
        layout = KVLayout(
            num_layers=len(names),
            num_kv_heads=1,
            head_dim=int(spec.head_size),
            block_size=block_size,
            dtype=dtype,
            kv_order="LATENT_LAYER_TOKEN",
        )
        return KVGroup(index, "mla", layout, tuple(names))
    head_v = int(getattr(spec, "head_size_v", spec.head_size) or spec.head_size)
    if head_v != int(spec.head_size):
        raise InvalidArgument(
            f"the kvstore connector needs K and V of one head size; KV cache group {index} "
            f"has K {spec.head_size} and V {head_v}"
        )
    layout = KVLayout(
        num_layers=len(names),
        num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        block_size=block_size,
        dtype=dtype,
    )
    if kind_name == "SlidingWindowSpec":
        return KVGroup(index, "sliding", layout, tuple(names), window=int(spec.sliding_window))
    # A FullAttentionSpec may carry a sliding window or an attention chunk: vLLM's hybrid
    # manager is off, every block is allocated and computed, and the kernel applies the
    # window. Caching every block is then exactly what vLLM's own prefix cache does.
    return KVGroup(index, "full", layout, tuple(names))


def block_order(vllm_config: Any) -> BlockOrder:
    """The pool order of an engine's blocks: its own page order on a CPU engine."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
    return "cpu" if device == "cpu" else "canonical"


def tp_size(vllm_config: Any) -> int:
    """The engine's tensor-parallel size."""
    return int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1))


def namespace_model_id(vllm_config: Any, layout: KVLayout, configured: str = "") -> str:
    """The namespace's model id for an engine, before its rank (see the module docstring).

    Raises:
        InvalidArgument: pipeline parallelism above 1 (or data/context parallel
            shapes the connector cannot split by rank).
    """
    parallel = vllm_config.parallel_config
    pp = int(getattr(parallel, "pipeline_parallel_size", 1))
    if pp != 1:
        raise InvalidArgument(
            f"the kvstore connector does not support pipeline parallelism (size {pp}): "
            "each stage holds other layers"
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(parallel, name, 1) or 1)
        if size != 1:
            raise InvalidArgument(
                f"the kvstore connector does not support {name} {size}: "
                "each rank holds other tokens of a block"
            )
    model = vllm_config.model_config
    name = configured or f"{model.model}@{model.revision or 'default'}"
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    weights = str(getattr(model, "dtype", "") or "").removeprefix("torch.") or "unknown"
    quantization = getattr(model, "quantization", None)
    if quantization:
        weights += f"-q-{quantization}"
    if len(name) > 160:  # a long local path: keep its end, and a digest of all of it
        name = name[-120:] + "~" + hashlib.sha256(name.encode()).hexdigest()[:16]
    order = block_order(vllm_config)
    return (
        f"vllm:{name}#cfg-{config_fingerprint(model.hf_config)}#w-{weights}"
        f"#kv-{cache_dtype}-{layout.dtype}#bs-{layout.block_size}"
        + ("" if order == "canonical" else f"#order-{order}")
    )


def config_fingerprint(hf_config: Any) -> str:
    """12 hex digits of SHA-256 over the model's config, less runtime keys."""
    try:
        doc = hf_config.to_dict()
    except AttributeError:
        doc = dict(vars(hf_config))
    doc = {k: v for k, v in doc.items() if not k.startswith("_") and k not in _RUNTIME_KEYS}
    encoded = json.dumps(doc, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(encoded.encode()).hexdigest()[:12]
