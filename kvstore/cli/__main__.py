"""``python -m kvstore.cli``."""

from __future__ import annotations

from kvstore.cli.app import main

main()
