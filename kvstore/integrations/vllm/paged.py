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

How a block's bytes are ordered in the pool is the namespace's **block
order** (`BlockOrder`), part of its model id:

``canonical`` ``[2, layers, block_size, kv_heads, head_dim]``: GPU engines (their
              pages are already K then V per layer, contiguous per block);
``cpu``       ``[layers, kv_heads, 2, block_size, head_dim]``: CPU engines. This is
              the CPU backend's own page, layer after layer, so a load or a save
              is one contiguous copy per block and layer (about half the time of
              the permuting copy from the canonical order).

Copies go through `as_canonical`, a view with the canonical shape whatever
the order, so every layout pair is handled by the same code; when the
order matches the backend, that view has the page's own strides and the
copy runs at memory speed (timings: benchmarks/README.md, `bench_vllm.py`).
The conversion is a permutation of the same elements: loading what was
saved gives back the exact bytes.

Loads on the CPU copy each run of adjacent pool slots going to adjacent
vLLM blocks with one copy per layer (`scatter_runs`); otherwise, and for
saves, each block is copied into its place per layer then per block: on the
CPU this reads the mapped pool once, with no staging tensor, about twice as
fast as stacking the blocks and scattering them. On a GPU, where each copy
is a kernel launch, the blocks are stacked once and gathered or scattered
per layer instead. Tensors may live on any device: with a CUDA pool both
sides are device memory and the copies stay on the device.
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

BlockOrder = Literal["canonical", "cpu"]
"""How a block's bytes are ordered in the pool (see the module docstring)."""


def stored_shape(layout: KVLayout, order: BlockOrder) -> tuple[int, ...]:
    """The shape of one block as stored in ``order``."""
    if order == "canonical":
        return layout.block_shape
    return (
        layout.num_layers,
        layout.num_kv_heads,
        layout.kv_parts,
        layout.block_size,
        layout.head_dim,
    )


def as_canonical(stored: torch.Tensor, layout: KVLayout, order: BlockOrder) -> torch.Tensor:
    """A view of blocks stored in ``order`` (any leading dimensions, then one block's
    elements, contiguous) with the canonical shape ``[..., 2, layers, bs, heads, dim]``."""
    lead = tuple(stored.shape[: stored.dim() - len(layout.block_shape)])
    if order == "canonical":
        return stored.view(*lead, *layout.block_shape)
    native = stored.view(*lead, *stored_shape(layout, order))  # [..., L, H, 2, bs, D]
    k = len(lead)
    return native.permute(*range(k), k + 2, k, k + 3, k + 1, k + 4)


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
        if self.kind == "cpu":  # [nb, H, bs, P*D] -> [nb, H, P, bs, D] (P: 2, or 1 latent)
            return t.view(t.shape[0], lay.num_kv_heads, lay.kv_parts, lay.block_size, lay.head_dim)
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

    def write_blocks(self, first: int, kv: torch.Tensor) -> None:
        """Copy ``kv`` (``[n, 2, block_size, kv_heads, head_dim]``) into blocks ``first`` to
        ``first + n - 1``: one copy (strided when the source is a run of pool slots)."""
        n = int(kv.shape[0])
        if self.kind == "cpu":  # [n, H, 2, bs, D]
            self._blocked()[first : first + n].copy_(kv.permute(0, 3, 1, 2, 4))
        else:  # [2, n, bs, H, D]
            self.tensor[:, first : first + n].copy_(kv.permute(1, 0, 2, 3, 4))

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
    bs, heads, dim, parts = layout.block_size, layout.num_kv_heads, layout.head_dim, layout.kv_parts
    shape = tuple(tensor.shape)
    if parts == 1 and len(shape) == 3 and shape[1:] == (bs, dim) and tensor.is_contiguous():
        # MLA on GPU backends: [blocks, bs, latent], the same bytes as the CPU page
        return PagedLayer(tensor.view(shape[0], 1, bs, dim), "cpu", layout)
    if len(shape) == 4 and shape[1:] == (heads, bs, parts * dim) and tensor.is_contiguous():
        return PagedLayer(tensor, "cpu", layout)
    if parts == 2 and len(shape) == 5 and shape[0] == 2 and shape[2:] == (bs, heads, dim):
        return PagedLayer(tensor, "flash", layout)
    raise InvalidArgument(
        f"vLLM KV cache tensor of shape {shape} is neither [blocks, {heads}, {bs}, {parts * dim}] "
        f"(CPU) nor [2, blocks, {bs}, {heads}, {dim}] (flash): this attention backend "
        "is not supported by the kvstore connector"
    )


def gather_blocks(
    layers: Sequence[PagedLayer],
    block_ids: Sequence[int],
    layout: KVLayout,
    order: BlockOrder = "canonical",
) -> torch.Tensor:
    """The kvstore blocks of vLLM ``block_ids``, stored in ``order``: ``[n, *stored_shape]``
    (contiguous: row ``i`` is block ``i``'s bytes for the pool)."""
    if not layers:
        raise InvalidArgument("no KV cache layers were registered")
    device = layers[0].tensor.device
    stored = torch.empty(
        (len(block_ids), *stored_shape(layout, order)),
        dtype=layers[0].tensor.dtype,
        device=device,
    )
    out = as_canonical(stored, layout, order)
    if device.type != "cpu":  # one kernel launch per layer, not per block and layer
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        for index, layer in enumerate(layers):
            out[:, :, index] = layer.gather(ids)
        return stored
    for index, layer in enumerate(layers):
        for row, block_id in enumerate(block_ids):
            layer.read_block(block_id, out[row, :, index])
    return stored


def scatter_runs(layers: Sequence[PagedLayer], runs: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Write runs of canonical blocks into runs of adjacent vLLM blocks.

    Args:
        layers: the engine's paged layers.
        runs: ``(first vLLM block id, [n, 2, layers, bs, heads, dim])`` each: ``n`` adjacent
            pool slots (an `as_canonical` view of them) going to blocks ``first`` to
            ``first + n - 1``. One copy per layer and run instead of one per layer and block.
    """
    for _, run in runs:
        if run.dim() != 6 or int(run.shape[2]) != len(layers):
            raise InvalidArgument(f"a run of shape {tuple(run.shape)} for {len(layers)} layers")
    for index, layer in enumerate(layers):
        for first, run in runs:
            layer.write_blocks(first, run[:, :, index])


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
            block each (views of the pool's slots: nothing is staged), in the
            canonical shape (`as_canonical` views of blocks in another order).
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
