"""The ``kvstore`` ops command: a gRPC client of cache nodes (docs/operations.md).

Read commands print rich tables, or JSON with ``--json``; admin commands
need the node's admin token. `prefix_tree` and `summary` are pure and also
used by the node's web page.
"""

from __future__ import annotations

from kvstore.cli.app import app, main

__all__ = ["app", "main"]
