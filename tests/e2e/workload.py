"""What the e2e runners and tests agree on: the layout, prompts and block bytes.

Block bytes are a deterministic function of the block's chained hash
(`expected_block`), so any process can check, byte for byte, a block that
another process wrote without the two exchanging anything but the prompt.
"""

from __future__ import annotations

import hashlib
import random

import grpc
import numpy as np
import numpy.typing as npt

from kvstore.client import Namespace
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc

MODEL_ID = "e2e-model"
"""Model id of the namespace the runners share (unless a test names another)."""

BLOCK_SIZE = 16
"""Tokens per block."""

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BLOCK_SIZE, dtype="float16")
"""2 (K, V) x 2 layers x 16 tokens x 2 heads x 16 dims x 2 bytes = 4 KiB per block."""

BLOCK_BYTES = LAYOUT.block_bytes

VOCAB = 32000
"""Token ids are drawn from [1, VOCAB)."""


def expected_block(block_hash: bytes, nbytes: int = BLOCK_BYTES) -> npt.NDArray[np.uint8]:
    """The bytes every runner writes for the block keyed ``block_hash``.

    A numpy generator seeded with the whole 256-bit hash, so two different
    blocks practically never get the same bytes.
    """
    rng = np.random.default_rng(int.from_bytes(block_hash, "little"))
    return np.frombuffer(rng.bytes(nbytes), dtype=np.uint8)


def block_digest(data: bytes | memoryview | npt.NDArray[np.generic]) -> str:
    """Short SHA-256 hex of a block's bytes (what runners report to compare)."""
    raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    return hashlib.sha256(raw).hexdigest()[:16]


def tokens(seed: int | str, count: int) -> list[int]:
    """``count`` token ids drawn deterministically from ``seed``."""
    rng = random.Random(f"e2e-tokens/{seed}")
    return [rng.randrange(1, VOCAB) for _ in range(count)]


def system_prompt(name: int | str, count: int = 72) -> list[int]:
    """A system prompt: 72 tokens by default, i.e. 4 full blocks and 8 tokens more."""
    return tokens(f"system/{name}", count)


def user_prompt(name: int | str, count: int = 40) -> list[int]:
    """A user prompt."""
    return tokens(f"user/{name}", count)


async def verify_ready_blocks(target: str, ns: Namespace) -> tuple[int, int]:
    """Read every READY block of ``ns`` through its mapping and compare its bytes.

    Orphaned blocks (unreachable by lookups) are read too: ListBlocks names
    every resident block. Returns (READY blocks read, mismatches).
    """
    assert ns.mapping is not None
    ready = mismatches = 0
    async with grpc.aio.insecure_channel(target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        token = ""
        while True:
            page = await stub.ListBlocks(
                pb.ListBlocksRequest(namespace_id=ns.id, page_size=1000, page_token=token),
                timeout=10.0,
            )
            for info in page.blocks:
                if info.state != pb.BLOCK_STATE_READY:
                    continue
                ready += 1
                data = ns.mapping.buffer(info.slot)
                mismatches += bytes(data) != expected_block(info.hash).tobytes()
                del data
            token = page.next_page_token
            if not token:
                return ready, mismatches
