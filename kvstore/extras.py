"""Optional dependencies: each is imported on first use, or names the extra that installs it.

``pip install kvstore`` is the node, the runner SDK (numpy views) and the
CLI; nothing there imports torch. Torch tensors over pool memory, CUDA pools
and the model integrations need extras (pyproject.toml):

* ``torch``: torch views of blocks (``Hit.torch_views``, ``torch_view``);
* ``cuda``: CUDA pools (cupy, and torch for their tensors);
* ``hf``: ``kvstore.integrations.transformers`` and ``examples/chat_runner.py``;
* ``vllm``: the vLLM connector;
* ``events``: vLLM KV events, published and ingested (pyzmq, msgpack; `service.vllm_events`).
"""

from __future__ import annotations

import importlib
import sys

CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
"""A CPU-only torch: PyPI's default Linux build pulls CUDA and its NVIDIA wheels (GBs)."""


class MissingExtra(ImportError):
    """A feature needs an optional dependency that is not installed; the message says how."""


def require_torch(feature: str) -> None:
    """Make sure torch imports, else raise `MissingExtra` naming the ``torch`` extra.

    Args:
        feature: what needed it, for the message ("torch views of blocks").
    """
    if sys.modules.get("torch") is not None:
        return  # imported already: the common case, on every view
    try:
        importlib.import_module("torch")
    except ImportError as exc:
        raise MissingExtra(
            f"{feature} need torch, which is not installed: pip install 'kvstore[torch]' "
            f"(or, for a CPU-only torch without the CUDA wheels: {CPU_TORCH}); "
            "numpy views (numpy_views, numpy_view) work without it"
        ) from exc
