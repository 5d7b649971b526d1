"""vLLM engines reusing each other's prefixes through a kvstore cache node.

    LLM(
        model=...,
        kv_transfer_config={
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"target": "127.0.0.1:50051", "tenant": "acme"},
        },
    )

`KVStoreConnector` (needs vLLM) is imported lazily, so the pure parts
(`ConnectorConfig`, the copy kernels in `paged`) import without vLLM.
See `docs/vllm.md`.
"""

from __future__ import annotations

from typing import Any

from kvstore.integrations.vllm.config import ConnectorConfig

__all__ = ["ConnectorConfig", "KVStoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVStoreConnector":
        from kvstore.integrations.vllm.connector import KVStoreConnector

        return KVStoreConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
