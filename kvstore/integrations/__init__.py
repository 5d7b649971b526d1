"""Integrations of the runner SDK with model code.

Each integration lives in its own module and imports its framework there, so
importing `kvstore.integrations` needs nothing beyond `kvstore` itself:

- `kvstore.integrations.transformers`: Hugging Face transformers causal LMs
  (`CachedPrefill`) reusing KV blocks from a cache node.
"""

from __future__ import annotations

__all__: list[str] = []
