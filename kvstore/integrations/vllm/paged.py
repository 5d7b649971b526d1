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

Loads copy each pool block straight into its place, per layer then per
block, and saves copy each block out the same way: on the CPU this reads the
mapped pool once, with no staging tensor, about twice as fast as stacking
the blocks and scattering them (16 blocks of 1.2 MB: about 3 ms instead of
6-8 ms). On a GPU, where each copy is a kernel launch, the blocks are
stacked once and gathered or scattered per layer instead. Tensors may live
on any device: with a CUDA pool both sides are device memory and the copies
stay on the device.
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

    def read_block(self, block_id: int, out: torch.Tensor) -> None:
        """Copy ``block_id``'s K and V into ``out`` (``[2, block_size, kv_heads, head_dim]``)."""
        if self.kind == "cpu":  # [H, 2, bs, D]
            out.copy_(self._blocked()[block_id].permute(1, 2, 0, 3))
        else:  # [2, bs, H, D]
            out.copy_(self.tensor[:, block_id])

    def write_block(self, block_id: int, kv: torch.Tensor) -> None:
        """Copy one block's K and V (``[2, block_size, kv_heads, head_dim]``) into ``block_id``."""
        if self.kind == "cpu":  # [H, 2, bs, D]
            self._blocked()[block_id].copy_(kv.permute(2, 0, 1, 3))
        else:  # [2, bs, H, D]
            self.tensor[:, block_id].copy_(kv)


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
    out = torch.empty(
        (len(block_ids), *layout.block_shape), dtype=layers[0].tensor.dtype, device=device
    )
    if device.type != "cpu":  # one kernel launch per layer, not per block and layer
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        for index, layer in enumerate(layers):
            out[:, :, index] = layer.gather(ids)
        return out
    for index, layer in enumerate(layers):
        for row, block_id in enumerate(block_ids):
            layer.read_block(block_id, out[row, :, index])
    return out


def scatter_blocks(
    layers: Sequence[PagedLayer],
    block_ids: Sequence[int],
    blocks: torch.Tensor | Sequence[torch.Tensor],
) -> None:
    """Write canonical blocks into vLLM ``block_ids``.

    Args:
        layers: the engine's paged layers.
        block_ids: where each block goes.
        blocks: ``[n, 2, layers, bs, heads, dim]``, or ``n`` tensors of one
            block each (views of the pool's slots: nothing is staged).
    """
    shapes = {tuple(block.shape) for block in blocks}
    if len(blocks) != len(block_ids) or any(shape[1:2] != (len(layers),) for shape in shapes):
        raise InvalidArgument(
            f"{len(blocks)} blocks of shapes {sorted(shapes)} for {len(block_ids)} "
            f"block ids of {len(layers)} layers"
        )
    if not block_ids:
        return
    device = layers[0].tensor.device
    if device.type != "cpu":  # one kernel launch per layer, not per block and layer
        stacked = blocks if isinstance(blocks, torch.Tensor) else torch.stack(list(blocks))
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        for index, layer in enumerate(layers):
            layer.scatter(ids, stacked[:, :, index])
        return
    for index, layer in enumerate(layers):
        for block_id, block in zip(block_ids, blocks, strict=True):
            layer.write_block(block_id, block[:, index])
