"""The ``kvstore`` ops command: a gRPC client of cache nodes (docs/operations.md).

Read commands print rich tables, or JSON with ``--json``; admin commands
need the node's admin token. The views they draw (the prefix tree, the JSON
summaries) live in `kvstore.ops`, which the node's web page uses too.
"""

from __future__ import annotations

from kvstore.cli.app import app, main

__all__ = ["app", "main"]
