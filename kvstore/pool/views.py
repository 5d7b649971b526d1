"""Typed zero-copy views of one block's bytes: numpy arrays and torch tensors.

A block is a C-contiguous array of shape ``layout.block_shape`` (see
`kvstore.layout.KV_ORDERS`). Both helpers wrap the given buffer without
copying, so writing through the view writes the pool.

numpy has no ``bfloat16`` or float8 dtypes: those come back as unsigned
integers of the same width (the bits are unchanged; ``torch_block_view``
gives the real dtype). torch is imported on first use only, so a process that
never asks for a tensor (the server) does not pay for importing it, and an
install without torch works until a tensor is asked for (then `MissingExtra`
says which extra to install).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvstore.errors import InvalidArgument
from kvstore.extras import require_torch

if TYPE_CHECKING:
    import torch

    from kvstore.layout import KVLayout

NUMPY_DTYPES: dict[str, str] = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "uint16",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
    "int8": "int8",
    "uint8": "uint8",
}
"""numpy dtype used for each layout dtype (same width; bit-identical)."""


def _check_size(buffer: memoryview, layout: KVLayout) -> None:
    if buffer.nbytes != layout.block_bytes:
        raise InvalidArgument(
            f"a block of this layout is {layout.block_bytes} bytes, the buffer is {buffer.nbytes}"
        )


def numpy_block_view(buffer: memoryview, layout: KVLayout) -> npt.NDArray[np.generic]:
    """A writable numpy array over ``buffer`` shaped ``layout.block_shape``, no copy."""
    _check_size(buffer, layout)
    flat = np.frombuffer(buffer, dtype=np.dtype(NUMPY_DTYPES[layout.dtype]))
    return flat.reshape(layout.block_shape)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layout dtype name (``"bfloat16"`` → ``torch.bfloat16``)."""
    require_torch("torch dtypes")
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"this torch build has no dtype {name!r}")
    return dtype


def torch_block_view(buffer: memoryview, layout: KVLayout) -> torch.Tensor:
    """A writable CPU tensor over ``buffer`` shaped ``layout.block_shape``, no copy.

    Raises:
        MissingExtra: torch is not installed (the ``torch`` extra).
    """
    require_torch("torch views of blocks")
    import torch

    _check_size(buffer, layout)
    if buffer.readonly:
        # torch.frombuffer warns on read-only buffers (and writing would crash).
        raise InvalidArgument("cannot make a tensor over a read-only buffer")
    flat = torch.frombuffer(buffer, dtype=torch_dtype(layout.dtype))
    return flat.view(layout.block_shape)
