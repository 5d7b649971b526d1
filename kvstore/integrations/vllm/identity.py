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
- the **tensor-parallel shape**: with ``tensor_parallel_size`` N > 1 each
  rank holds its share of the KV heads and gets a namespace of its own,
  ``<model id>#tp-N.<rank>`` (`rank_model_ids`): engines with the same model
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
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.integrations.vllm.paged import BlockOrder
from kvstore.layout import DTYPE_BYTES, KVLayout

_RUNTIME_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype", "_name_or_path"})


def kv_layout(kv_cache_config: Any) -> tuple[KVLayout, list[str]]:
    """The kvstore layout of an engine's KV and its attention layer names, in order.

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig`` as given to the connector.

    Raises:
        InvalidArgument: hybrid models (several KV groups), sliding windows,
            MLA or a dtype kvstore cannot store.
    """
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise InvalidArgument(
            f"the kvstore connector supports one KV cache group, this model has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind != "FullAttentionSpec" or getattr(spec, "sliding_window", None):
        raise InvalidArgument(
            f"the kvstore connector needs full attention KV, this model has {kind}"
        )
    if getattr(spec, "use_mla", False):
        raise InvalidArgument("the kvstore connector does not support MLA caches")
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise InvalidArgument(f"KV of dtype {dtype} cannot be stored in kvstore")
    names = list(groups[0].layer_names)
    layout = KVLayout(
        num_layers=len(names),
        num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        block_size=int(spec.block_size),
        dtype=dtype,
    )
    return layout, names


def block_order(vllm_config: Any) -> BlockOrder:
    """The pool order of an engine's blocks: its own page order on a CPU engine."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
    return "cpu" if device == "cpu" else "canonical"


def rank_model_ids(vllm_config: Any, model_id: str) -> list[str]:
    """One model id per tensor-parallel rank, in rank order (``model_id`` alone at TP 1)."""
    tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1))
    if tp == 1:
        return [model_id]
    return [f"{model_id}#tp-{tp}.{rank}" for rank in range(tp)]


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
