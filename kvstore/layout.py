"""KV layouts and namespaces: what fixes the bytes of one block.

A namespace is a model id plus the KV layout its runners write plus the hash
scheme; blocks of different namespaces never mix. Its id is derived from all
of these, so two runners that disagree on the layout cannot share blocks by
accident, and re-registering the same model id with another layout is a
`LayoutConflict`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from kvstore.errors import InvalidArgument
from kvstore.hashing import HashScheme
from kvstore.types import NamespaceId

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
"""Element sizes of the dtypes a layout may use (torch names)."""

KV_ORDERS = ("KV_LAYER_TOKEN_HEAD", "LATENT_LAYER_TOKEN")
"""Supported element orders of one block. ``KV_LAYER_TOKEN_HEAD`` means the
block is a C-contiguous array of shape ``[2, layers, block_size, kv_heads,
head_dim]``: K then V, each layer's tokens, heads, head dims.
``LATENT_LAYER_TOKEN`` is a model with one latent vector per token and layer
instead of K and V (DeepSeek's MLA: the compressed KV and its rope part):
``[1, layers, block_size, 1, head_dim]``, ``num_kv_heads`` 1."""

KV_PARTS = {"KV_LAYER_TOKEN_HEAD": 2, "LATENT_LAYER_TOKEN": 1}
"""How many tensors per layer each order holds: K and V, or the one latent."""

MAX_BLOCK_BYTES = 1 << 30
"""A single block larger than 1 GiB is certainly a mistake."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and element type of one cached block."""

    num_layers: int
    """Transformer layers whose K and V the block holds."""
    num_kv_heads: int
    """KV heads per layer (after GQA grouping)."""
    head_dim: int
    """Elements per head."""
    block_size: int
    """Tokens per block; only full blocks are cached."""
    dtype: str
    """Element type, a key of `DTYPE_BYTES`."""
    kv_order: str = "KV_LAYER_TOKEN_HEAD"
    """Element order inside a block, one of `KV_ORDERS`."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"layout.{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise InvalidArgument(
                f"layout.dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}"
            )
        if self.kv_order not in KV_ORDERS:
            raise InvalidArgument(f"layout.kv_order {self.kv_order!r} is not one of {KV_ORDERS}")
        if self.kv_parts == 1 and self.num_kv_heads != 1:
            raise InvalidArgument(
                f"layout.kv_order {self.kv_order} holds one latent per token: num_kv_heads "
                f"must be 1, got {self.num_kv_heads}"
            )
        if self.block_bytes > MAX_BLOCK_BYTES:
            raise InvalidArgument(f"one block would be {self.block_bytes} bytes, over 1 GiB")

    @property
    def kv_parts(self) -> int:
        """Tensors per layer and token: 2 (K and V), or 1 (a latent, `KV_ORDERS`)."""
        return KV_PARTS[self.kv_order]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block as an array: ``(parts, layers, block_size, kv_heads, head_dim)``
        (``parts`` 2, K then V; 1 for a latent)."""
        return (self.kv_parts, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V (or the latent) of every layer, token, head and dim."""
        return (
            self.kv_parts
            * self.num_layers
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * DTYPE_BYTES[self.dtype]
        )


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """What a runner declares: a model, its KV layout and the hash scheme."""

    model_id: str
    """Free-form model name (``meta-llama/Llama-3.1-8B``); 1-256 characters."""
    layout: KVLayout
    """The KV layout every block of this namespace has."""
    scheme: HashScheme = HashScheme.KVSTORE_SHA256
    """How block hashes are chained (see `kvstore.hashing`)."""
    vllm_seed: str = ""
    """For `HashScheme.VLLM_SHA256_CBOR`: the PYTHONHASHSEED vLLM runs with."""

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not 0 < len(self.model_id) <= 256:
            raise InvalidArgument("model_id must be a non-empty string of at most 256 characters")
        if self.scheme is HashScheme.VLLM_SHA256_CBOR and not self.vllm_seed:
            raise InvalidArgument(
                "the vllm-sha256-cbor scheme needs vllm_seed (vLLM's PYTHONHASHSEED)"
            )

    def digest(self) -> bytes:
        """32-byte digest of a canonical JSON encoding of the whole spec."""
        doc = {
            "model_id": self.model_id,
            "layout": asdict(self.layout),
            "scheme": self.scheme.value,
            "vllm_seed": self.vllm_seed,
        }
        encoded = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(b"kvstore/namespace/v1\0" + encoded).digest()

    @property
    def namespace_id(self) -> NamespaceId:
        """Short stable id: the first 8 bytes of `digest` as hex."""
        return NamespaceId(self.digest()[:8].hex())
