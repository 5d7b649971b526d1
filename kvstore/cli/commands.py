"""Importing this module registers every ``kvstore`` subcommand on `kvstore.cli.app.app`."""

from __future__ import annotations

from kvstore.cli import admin, bench, live, reads

__all__ = ["admin", "bench", "live", "reads"]
