"""The fuzzed node: its config and the layout the fuzzers register."""

from __future__ import annotations

from typing import Any

from kvstore.v1 import kvstore_pb2 as pb
from service.config import Config

LAYOUT = pb.KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float16")


def config(tmp_path: Any) -> Config:
    return Config(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        capacity_bytes=4 << 20,
        namespace_capacity_bytes=64 * 256,
        arena_bytes=16 * 256,
        shm_dir=str(tmp_path),
        pool_prefix="kvfuzz",
        pool_prefault=False,
        node_id="fuzz-node",
        salt_secret=bytes(range(32)),
        grace_seconds=0.1,
        max_message_bytes=1 << 20,
        max_chain_blocks=256,
    )
