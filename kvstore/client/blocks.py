"""Turning what a runner hands over (arrays, tensors, bytes) into block bytes.

`BlockSource` is whatever `Client.store` accepts per block. torch is never
imported here: a tensor is recognised only if the runner already imported
torch, which it must have to make one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from kvstore.checksum import block_checksum
from kvstore.errors import InvalidArgument
from kvstore.pool.cuda_caller import caller_streams

BlockSource: TypeAlias = Any
"""One block: bytes-like, a numpy array or a torch tensor (torch is optional, hence Any)."""

BlockSupplier: TypeAlias = (
    Sequence[BlockSource] | np.ndarray[Any, Any] | Callable[[int], BlockSource]
)
"""Blocks by chain index: a sequence, one ``(n_blocks, ...)`` array, or a callable
``i -> block`` (called lazily)."""


def block_at(blocks: BlockSupplier, index: int) -> BlockSource:
    """The block at chain ``index`` from a sequence or a callable."""
    if callable(blocks):
        return blocks(index)
    if index >= len(blocks):
        raise InvalidArgument(f"got {len(blocks)} blocks, block {index} of the chain is missing")
    return blocks[index]


def copy_block_hashed(source: BlockSource, target: memoryview) -> int:
    """Copy one block's bytes into ``target`` (exactly as many bytes as it has); the
    checksum of the bytes copied (`kvstore.checksum`), taken from the *source*.

    The source is hashed right after its copy, while its bytes are still in
    the CPU's cache (about a fifth of a copy's cost for a 256 KiB block, not a
    second pass over memory), and never from ``target``: a late writer of the
    same slot can change the slot, not the caller's source, so the checksum
    is always of the bytes this writer meant (issue 40, item 2).

    Raises:
        InvalidArgument: the block has another size, or is not bytes-like,
            an array or a tensor.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(source, torch.Tensor):
        flat = source.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        _check(flat.numel(), target)
        torch.frombuffer(target, dtype=torch.uint8).copy_(flat)
        return block_checksum(flat.numpy())
    if isinstance(source, np.ndarray):
        data = np.ascontiguousarray(source).reshape(-1).view(np.uint8).data
    else:
        try:
            data = memoryview(source).cast("B")
        except TypeError as exc:
            raise InvalidArgument(
                f"a block must be bytes, a numpy array or a torch tensor, got {type(source)!r}"
            ) from exc
    _check(data.nbytes, target)
    target[:] = data
    return block_checksum(data)


def copy_block_to_tensor(source: BlockSource, target: Any) -> None:
    """Copy one block's bytes into a tensor of a CUDA pool slot (``target``, any dtype).

    A GPU source is copied device to device; a host source is uploaded. The
    copy is queued on the caller's current stream (the thread that called
    `SyncClient.store`, not the client's loop thread: see
    `kvstore.pool.cuda_caller`), so it runs after the kernels that made the
    source; the caller synchronises before Commit
    (`kvstore.pool.PoolMapping.synchronize`).

    Raises:
        InvalidArgument: the block has another size, or is not bytes-like,
            an array or a tensor.
    """
    import torch

    flat_target = target.reshape(-1).view(torch.uint8)
    if isinstance(source, torch.Tensor):
        flat = source.detach().contiguous().reshape(-1).view(torch.uint8)
    else:
        if isinstance(source, np.ndarray):
            array = np.ascontiguousarray(source).reshape(-1).view(np.uint8)
        else:
            try:
                array = np.frombuffer(memoryview(source).cast("B"), dtype=np.uint8)
            except TypeError as exc:
                raise InvalidArgument(
                    f"a block must be bytes, a numpy array or a torch tensor, got {type(source)!r}"
                ) from exc
        if not array.flags.writeable:
            array = array.copy()  # torch refuses (warns on) read-only memory
        flat = torch.from_numpy(array)
    if flat.numel() != flat_target.numel():
        raise InvalidArgument(f"a block is {flat_target.numel()} bytes, got {flat.numel()}")
    with caller_streams():
        flat_target.copy_(flat)


def slot_runs(slots: Sequence[int], positions: Sequence[int], slots_per_arena: int) -> list[int]:
    """Where runs start: blocks whose slots *and* positions are adjacent, in one arena.

    Returns the start of each run in ``slots``, then ``len(slots)``: run *r*
    is ``slots[starts[r] : starts[r + 1]]``, and copies one arena range to
    (or from) one range of the caller's array. Slots never straddle arenas,
    so a slot that begins an arena begins a run.
    """
    if not slots:
        return [0]  # no runs
    starts = [0]
    for k in range(1, len(slots)):
        slot = slots[k]
        if (
            slot != slots[k - 1] + 1
            or positions[k] != positions[k - 1] + 1
            or not (slot % slots_per_arena)
        ):
            starts.append(k)
    starts.append(len(slots))
    return starts


def chain_array(blocks: object, block_bytes: int) -> npt.NDArray[np.uint8] | None:
    """``blocks`` as rows of bytes when it is one C-contiguous array of whole blocks, else None.

    Then a run of adjacent blocks is one slice of it: one copy, not one per block.
    """
    if not isinstance(blocks, np.ndarray) or blocks.ndim < 1 or not blocks.flags.c_contiguous:
        return None
    if not len(blocks) or blocks.nbytes != len(blocks) * block_bytes:
        return None
    return blocks.reshape(len(blocks), -1).view(np.uint8)


def block_bytes_of(source: BlockSource) -> bytes:
    """A block's bytes as one `bytes` object (for WriteBlocks)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(source, torch.Tensor):
        flat = source.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        return bytes(flat.numpy().tobytes())
    if isinstance(source, np.ndarray):
        return np.ascontiguousarray(source).tobytes()
    try:
        return memoryview(source).tobytes()
    except TypeError as exc:
        raise InvalidArgument(
            f"a block must be bytes, a numpy array or a torch tensor, got {type(source)!r}"
        ) from exc


def _check(size: int, target: memoryview) -> None:
    if size != target.nbytes:
        raise InvalidArgument(f"a block is {target.nbytes} bytes, got {size}")
