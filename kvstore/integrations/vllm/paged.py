"""Copy kernels between vLLM's paged KV cache and kvstore blocks.

A kvstore block holds every layer's K and V of ``block_size`` tokens, in the
layout's canonical order ``[2, layers, block_size, kv_heads, head_dim]``
(`kvstore.layout.KVLayout.block_shape`). vLLM keeps one tensor per attention
layer, paged by block id, in a shape its attention backend chooses:

``cpu``   (CPU attention, ``LBHNC``): ``[num_blocks, kv_heads, block_size, 2 * head_dim]``,
          each (block, head) being K of the block's tokens then V
          (the backend views it as ``[num_blocks, kv_heads, 2 * block_size, head_dim]``).
``flash`` (FlashAttention and the other GPU backends): ``[2, num_blocks, block_size,
          kv_heads, head_dim]``, K then V first.

Blocks are stored canonically, not in the engine's own order, so a block
means the same to every engine and to other runners (the transformers
integration) whatever backend computed it. The conversion is a permutation
of the same elements: loading what was saved gives back the exact bytes.

All copies are batched per layer (one gather or scatter of every block of
a step), so their cost grows with layers, not with blocks x layers.
Tensors may live on any device: on a GPU with a CUDA pool both sides are
device memory and the copies stay on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout

PagedKind = Literal["cpu", "flash"]
"""How one layer's paged tensor is laid out (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class PagedLayer:
    """One attention layer's paged KV tensor and how to address its blocks."""

    tensor: torch.Tensor
    """vLLM's tensor for the layer (not copied)."""
    kind: PagedKind
    """Its layout."""
    layout: KVLayout
    """The kvstore layout (block size, heads, head dim)."""

    @property
    def num_blocks(self) -> int:
        """Blocks the layer's tensor has room for."""
        return int(self.tensor.shape[0] if self.kind == "cpu" else self.tensor.shape[1])

    def _blocked(self) -> torch.Tensor:
        t, lay = self.tensor, self.layout
        if self.kind == "cpu":  # [nb, H, bs, 2D] -> [nb, H, 2, bs, D]
            return t.view(t.shape[0], lay.num_kv_heads, 2, lay.block_size, lay.head_dim)
        return t  # [2, nb, bs, H, D]

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        """K and V of ``block_ids``: a new tensor ``[n, 2, block_size, kv_heads, head_dim]``."""
        blocked = self._blocked()
        if self.kind == "cpu":
            return blocked[block_ids].permute(0, 2, 3, 1, 4)
        return blocked[:, block_ids].permute(1, 0, 2, 3, 4)

    def scatter(self, block_ids: torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``kv`` (``[n, 2, block_size, kv_heads, head_dim]``) into ``block_ids``."""
        blocked = self._blocked()
        kv = kv.to(device=blocked.device, dtype=blocked.dtype)
        if self.kind == "cpu":
            blocked[block_ids] = kv.permute(0, 3, 1, 2, 4)
        else:
            blocked[:, block_ids] = kv.permute(1, 0, 2, 3, 4)


def paged_layer(tensor: torch.Tensor, layout: KVLayout) -> PagedLayer:
    """Recognise a layer's paged tensor by its shape.

    Raises:
        InvalidArgument: the shape fits neither known layout for ``layout``
            (another backend, MLA, a quantised cache with scales...).
    """
    bs, heads, dim = layout.block_size, layout.num_kv_heads, layout.head_dim
    shape = tuple(tensor.shape)
    if len(shape) == 4 and shape[1:] == (heads, bs, 2 * dim) and tensor.is_contiguous():
        return PagedLayer(tensor, "cpu", layout)
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (bs, heads, dim):
        return PagedLayer(tensor, "flash", layout)
    raise InvalidArgument(
        f"vLLM KV cache tensor of shape {shape} is neither [blocks, {heads}, {bs}, {2 * dim}] "
        f"(CPU) nor [2, blocks, {bs}, {heads}, {dim}] (flash): this attention backend "
        "is not supported by the kvstore connector"
    )


def gather_blocks(
    layers: Sequence[PagedLayer], block_ids: Sequence[int], layout: KVLayout
) -> torch.Tensor:
    """Canonical kvstore blocks of vLLM ``block_ids``: ``[n, 2, layers, bs, heads, dim]``."""
    if not layers:
        raise InvalidArgument("no KV cache layers were registered")
    device = layers[0].tensor.device
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    out = torch.empty(
        (len(block_ids), *layout.block_shape), dtype=layers[0].tensor.dtype, device=device
    )
    for index, layer in enumerate(layers):
        out[:, :, index] = layer.gather(ids)
    return out


def scatter_blocks(
    layers: Sequence[PagedLayer], block_ids: Sequence[int], blocks: torch.Tensor
) -> None:
    """Write canonical blocks (``[n, 2, layers, bs, heads, dim]``) into vLLM ``block_ids``."""
    if blocks.shape[0] != len(block_ids) or blocks.shape[2] != len(layers):
        raise InvalidArgument(
            f"{blocks.shape[0]} blocks of {blocks.shape[2]} layers for {len(block_ids)} "
            f"block ids of {len(layers)} layers"
        )
    if not block_ids:
        return
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=layers[0].tensor.device)
    for index, layer in enumerate(layers):
        layer.scatter(ids, blocks[:, :, index])
