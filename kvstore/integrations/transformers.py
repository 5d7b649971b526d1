"""Hugging Face transformers causal LMs that skip prefill for cached prefixes.

    with SyncClient("127.0.0.1:50051", tenant="acme") as kv:
        runner = CachedPrefill(kv, model, "my-org/my-model@rev1", block_size=16)
        result = runner.prefill(token_ids)
        result.logits          # logits of the computed tail, as a full recompute gives them
        result.cache           # the model's KV cache of the whole prompt, ready for decoding

One `prefill` call:

1. looks the prompt up and pins its longest cached run of full blocks;
2. copies those blocks into the model's KV cache object (`DynamicCache`),
   proves the copy (`Hit.verify`: the slot stamps still read what the lookup
   answered once the copy has landed; a block whose stamp moved, and every
   block after it, is recomputed, never used), then releases the pins (the
   model owns a copy from here on);
3. runs the model only on the uncached tail, positions continuing after the
   cached prefix;
4. stores the newly completed full blocks back (reserve → copy → commit).

**Last-token rule.** The logits of a position come only from running the
model on it, so at least one token is always computed: of the hit blocks,
only those covering at most ``len(tokens) - 1`` tokens are reused. A prompt
that is entirely cached in full blocks recomputes its last block.

**What the namespace must identify.** KV depends on the exact weights, not
only on the layout. Two models with the same layout but different weights
(two fine-tunes, two checkpoints, two random seeds) must never share a
namespace, or one would decode with the other's KV and silently produce
wrong text. The namespace model id is therefore the caller's ``model_id``,
which **must name the exact weights** (repository *and* revision, or a
local checkpoint's digest), plus a fingerprint: of the config by default
(catches a different architecture behind the same name), or of every
weight (``fingerprint="weights"``; exact, but reads all parameters once).
A model whose layout differs from what its namespace was registered with is
refused by the node (`kvstore.errors.AlreadyExists`), never reused.

Only models whose cache is plain per-layer K and V of every position are
supported (Llama, Mistral without sliding windows, Qwen2, ...); caches with
sliding-window or recurrent layers are refused at construction.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from kvstore.client import Hit, Namespace, SyncClient
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.hashing import Extra
from kvstore.layout import DTYPE_BYTES, KVLayout

__all__ = [
    "CachedPrefill",
    "PrefillResult",
    "blocks_to_cache",
    "cache_argument",
    "cache_block",
    "config_fingerprint",
    "kv_layout_for",
    "weights_fingerprint",
]

log = logging.getLogger(__name__)

Fingerprint = Literal["config", "weights", "none"]
"""What `CachedPrefill` appends to the caller's model id (see the module docstring)."""

_RUNTIME_CONFIG_KEYS = frozenset(
    {"transformers_version", "torch_dtype", "dtype", "use_cache", "return_dict"}
    | {"output_attentions", "output_hidden_states", "attn_implementation"}
)
"""Config keys that do not change the KV (runtime switches; the dtype is in the layout)."""


def kv_layout_for(
    config: PretrainedConfig, *, block_size: int, dtype: torch.dtype = torch.float32
) -> KVLayout:
    """The kvstore layout of a model's KV: one block holds every layer's K and V.

    Args:
        config: the model's config (the text config is used for multimodal ones).
        block_size: tokens per block.
        dtype: the dtype of the model's KV (its parameters' dtype).

    Raises:
        InvalidArgument: the dtype cannot be stored, or the config lacks the sizes.
    """
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in DTYPE_BYTES:
        raise InvalidArgument(f"KV of dtype {dtype} cannot be stored; use one of {DTYPE_BYTES}")
    return KVLayout(
        num_layers=int(text.num_hidden_layers),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype_name,
    )


def config_fingerprint(config: PretrainedConfig) -> str:
    """16 hex digits of SHA-256 over the config, less runtime switches and private keys."""
    doc = {
        k: v
        for k, v in config.to_dict().items()
        if not k.startswith("_") and k not in _RUNTIME_CONFIG_KEYS
    }
    encoded = json.dumps(doc, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(encoded.encode()).hexdigest()[:16]


def weights_fingerprint(model: torch.nn.Module) -> str:
    """16 hex digits of SHA-256 over every parameter and buffer, by name (reads them all)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}:{data.dtype}:{tuple(tensor.shape)}\0".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def cache_block(cache: DynamicCache, index: int, layout: KVLayout) -> torch.Tensor:
    """Block ``index`` of a model's cache as one kvstore block (``layout.block_shape``).

    The cache holds ``[batch=1, kv_heads, seq, head_dim]`` per layer; a block
    is ``[2, layers, block_size, kv_heads, head_dim]``: K then V.
    """
    start, stop = index * layout.block_size, (index + 1) * layout.block_size
    keys, values = zip(*(_layer_kv(cache, i) for i in range(layout.num_layers)), strict=True)
    k = torch.stack([t[0, :, start:stop] for t in keys])  # [layers, heads, block, dim]
    v = torch.stack([t[0, :, start:stop] for t in values])
    if k.shape[2] != layout.block_size:
        raise InvalidArgument(f"the cache holds no full block {index}")
    return torch.stack([k, v]).transpose(2, 3).contiguous()


def blocks_to_cache(
    blocks: Sequence[torch.Tensor] | torch.Tensor,
    layout: KVLayout,
    config: PretrainedConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> DynamicCache:
    """A `DynamicCache` holding ``blocks`` (each ``layout.block_shape``) as positions 0...

    ``blocks`` may be one tensor of them stacked (``[n, *block_shape]``). The
    tensors are copied: the cache does not alias the pool, so the pins can be
    released as soon as this returns.
    """
    cache = _new_cache(config)
    if not len(blocks):
        return cache
    # [n, 2, layers, block, heads, dim]: one copy
    stacked = blocks if isinstance(blocks, torch.Tensor) else torch.stack(list(blocks))
    n = stacked.shape[0]
    for layer in range(layout.num_layers):
        kv = [
            stacked[:, part, layer]
            .reshape(n * layout.block_size, layout.num_kv_heads, layout.head_dim)
            .transpose(0, 1)
            .unsqueeze(0)
            .to(device=device, dtype=dtype)
            for part in (0, 1)
        ]
        cache.update(kv[0], kv[1], layer)
    return cache


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What one `CachedPrefill.prefill` did."""

    logits: torch.Tensor
    """Logits of the computed tail, ``[computed_tokens, vocab]`` (fewer with ``logits_to_keep``)."""
    cache: DynamicCache
    """The model's KV cache of the whole prompt (continue decoding from it)."""
    prompt_tokens: int
    """Tokens in the prompt."""
    hit_tokens: int
    """Tokens the node had cached (full blocks from the start)."""
    reused_tokens: int
    """Tokens whose KV came from the node (``hit_tokens`` less the last-token rule)."""
    computed_tokens: int
    """Tokens the model ran on: ``prompt_tokens - reused_tokens``, at least 1."""
    stored_blocks: int
    """New full blocks this call wrote to the node."""


class CachedPrefill:
    """Prefill of one transformers causal LM through a kvstore cache node."""

    def __init__(
        self,
        client: SyncClient,
        model: PreTrainedModel,
        model_id: str,
        *,
        block_size: int = 16,
        fingerprint: Fingerprint = "config",
        store: bool = True,
        capacity_bytes: int = 0,
        timeout: float | None = None,
    ) -> None:
        """Derive the model's layout and register its namespace (mapping the pool).

        Args:
            client: a connected client; its tenant scopes every block.
            model: a causal LM in eval mode, on any device.
            model_id: names the **exact weights** (e.g. ``org/name@revision``).
            block_size: tokens per cached block.
            fingerprint: appended to ``model_id`` for the namespace: ``"config"``
                (default), ``"weights"`` (exact, reads every parameter once) or
                ``"none"`` (``model_id`` already identifies the weights exactly).
            store: write newly computed full blocks back to the node.
            capacity_bytes: pool size to ask for on first registration (0: node default).
            timeout: deadline of each call to the node.

        Raises:
            InvalidArgument: the model's cache is not plain per-layer K/V.
            AlreadyExists: the namespace is registered with another layout.
        """
        self.client = client
        self.model = model
        self.store_blocks = store
        self.timeout = timeout
        self.layout = kv_layout_for(model.config, block_size=block_size, dtype=model.dtype)
        _check_plain_cache(model.config)
        self.namespace_model_id = model_id + _fingerprint_suffix(model, fingerprint)
        self.namespace: Namespace = client.register_namespace(
            self.namespace_model_id, self.layout, capacity_bytes=capacity_bytes, timeout=timeout
        )
        self._cache_kwarg = cache_argument(model)

    def prefill(
        self,
        tokens: Sequence[int] | torch.Tensor,
        *,
        extras: Sequence[Extra] | None = None,
        logits_to_keep: int = 0,
    ) -> PrefillResult:
        """Run the model on ``tokens`` reusing every cached full block it may.

        Args:
            tokens: the prompt's token ids (a 1-D sequence or tensor; batch of one).
            extras: per-block extra hash input (an adapter name, image hashes).
            logits_to_keep: return logits of only the last this many positions (0: all).

        Returns:
            The tail's logits, the model's cache of the whole prompt and the counts.

        A node that fails (unavailable, timing out) costs the reuse or the
        store of this call, never its result: the error is logged and the
        prompt computed in full.
        """
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() > 2 or (tokens.dim() == 2 and tokens.shape[0] != 1):
                raise InvalidArgument(
                    f"prefill takes one sequence, got shape {tuple(tokens.shape)}"
                )
            tokens = tokens.reshape(-1).tolist()
        ids = [int(t) for t in tokens]
        if not ids:
            raise InvalidArgument("prefill needs at least one token")
        block = self.layout.block_size
        hit_tokens, cache = self._reuse(ids, extras)
        reused = cache.get_seq_length()
        input_ids = torch.tensor([ids[reused:]], dtype=torch.long, device=self.model.device)
        kwargs: dict[str, Any] = {self._cache_kwarg: cache, "use_cache": True}
        if logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        with torch.no_grad():
            out = self.model(input_ids=input_ids, **kwargs)
        stored = 0
        full_blocks = len(ids) // block
        if self.store_blocks and full_blocks * block > hit_tokens:
            stored = self._store(ids[: full_blocks * block], cache, extras)
        return PrefillResult(
            logits=out.logits[0],
            cache=cache,
            prompt_tokens=len(ids),
            hit_tokens=hit_tokens,
            reused_tokens=reused,
            computed_tokens=len(ids) - reused,
            stored_blocks=stored,
        )

    def _reuse(self, ids: list[int], extras: Sequence[Extra] | None) -> tuple[int, DynamicCache]:
        """Look up and pin the prompt, copy the usable hit blocks into a new cache, release."""
        usable_blocks = (len(ids) - 1) // self.layout.block_size  # the last-token rule
        try:
            hit = self.client.lookup(
                self.namespace, ids, extras=extras, pin=True, timeout=self.timeout
            )
        except KVStoreError as exc:
            log.warning("kvstore lookup failed, computing the whole prompt: %s", exc)
            return 0, _new_cache(self.model.config)
        views: list[torch.Tensor] = []
        try:
            views = self._hit_views(hit, min(hit.hit_blocks, usable_blocks))
            cache = blocks_to_cache(
                self._proven(hit, views),
                self.layout,
                self.model.config,
                device=self.model.device,
                dtype=self.model.dtype,
            )
        except KVStoreError as exc:  # e.g. the node restarted between lookup and read
            log.warning("reading cached kvstore blocks failed, computing the whole prompt: %s", exc)
            return 0, _new_cache(self.model.config)
        finally:
            self._release(hit, self._read_streams(views))
        return hit.hit_tokens, cache

    def _proven(self, hit: Hit, views: list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        """The blocks of ``views`` copied out of the pool, cut at the first one whose stamp moved.

        One copy of the views (`torch.stack`); once it has landed (the read
        fence of a CUDA pool waits for the copy's streams), the hit's slot
        stamps are checked (`Hit.verify`): a block whose slot was rewritten
        or reused meanwhile, and every block after it, is dropped and
        recomputed by the forward. Blocks read over gRPC were read by the
        node under the pins: nothing to check here.
        """
        if not views or hit.mapping is None:
            return views
        copied = torch.stack(views)
        fence = hit.mapping.read_fence(self._read_streams(views))
        if fence is not None:
            fence()  # the copy has landed: only then do the stamps prove it
        verification = hit.verify(len(views))
        if not verification.ok:
            log.warning(
                "kvstore: %d of %d cached blocks were rewritten during the copy; "
                "recomputing from block %d",
                len(verification.moved),
                len(views),
                verification.intact,
            )
        return copied[: verification.intact]

    def _read_streams(self, views: list[torch.Tensor]) -> list[Any] | None:
        """The streams the copies out of the pool's views ran on (None: the client's default).

        The copies (`blocks_to_cache`) are queued on the current streams of
        the pool's GPU and the model's GPU; the pins may go only once they
        are complete, or another runner could rewrite a slot mid-copy.
        """
        if not views or views[0].device.type != "cuda":
            return None  # host views (the copies are done) or nothing read
        devices = {views[0].device}
        if self.model.device.type == "cuda":
            devices.add(self.model.device)
        return [torch.cuda.current_stream(d) for d in devices]

    def _hit_views(self, hit: Hit, count: int) -> list[torch.Tensor]:
        if count == 0:
            return []
        if hit.mapping is not None:
            return hit.torch_views()[:count]
        # A runner on another host has no mapping: the bytes come over gRPC.
        data = self.client.read_blocks(hit, timeout=self.timeout)[:count]
        dtype = getattr(torch, self.layout.dtype)
        return [
            torch.frombuffer(bytearray(b), dtype=dtype).view(self.layout.block_shape) for b in data
        ]

    def _release(self, hit: Hit, streams: list[Any] | None) -> None:
        try:
            self.client.release(hit, streams=streams, timeout=self.timeout)
        except KVStoreError as exc:  # the lease drops the pins when it ends
            log.warning("kvstore release failed (the lease will drop the pins): %s", exc)

    def _store(self, ids: list[int], cache: DynamicCache, extras: Sequence[Extra] | None) -> int:
        try:
            result = self.client.store(
                self.namespace,
                ids,
                lambda i: cache_block(cache, i, self.layout),
                extras=extras,
                timeout=self.timeout,
            )
        except KVStoreError as exc:
            log.warning("kvstore store failed, nothing cached from this prompt: %s", exc)
            return 0
        return result.committed


def _fingerprint_suffix(model: PreTrainedModel, fingerprint: Fingerprint) -> str:
    if fingerprint == "config":
        return "#cfg-" + config_fingerprint(model.config)
    if fingerprint == "weights":
        return "#w-" + weights_fingerprint(model)
    if fingerprint == "none":
        return ""
    raise InvalidArgument(f"fingerprint must be config, weights or none, got {fingerprint!r}")


# --- transformers versions ------------------------------------------------------------
# The cache API moved across releases: the forward argument (`past_key_values`, then
# `cache`), how layers are kept (`key_cache` lists, then `layers`), and whether the
# cache takes the config. These helpers hold every difference in one place.


def _new_cache(config: PretrainedConfig) -> DynamicCache:
    try:
        return DynamicCache(config=config)
    except TypeError:  # releases before the cache took a config
        return DynamicCache()


def _check_plain_cache(config: PretrainedConfig) -> None:
    layers = getattr(_new_cache(config), "layers", ())
    odd = sorted({type(layer).__name__ for layer in layers if getattr(layer, "is_sliding", False)})
    if odd:
        raise InvalidArgument(
            f"this model's cache has {', '.join(odd)} layers; only plain per-layer K/V of "
            "every position can be reused from kvstore"
        )


def cache_argument(model: PreTrainedModel) -> str:
    """The name of ``model.forward``'s KV cache argument (``cache``; ``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    legacy: Any = cache  # releases before `layers` kept per-layer lists
    return legacy.key_cache[layer], legacy.value_cache[layer]
