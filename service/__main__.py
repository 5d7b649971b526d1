"""``python -m service``: run a cache node (same as ``kvstore-server``)."""

from __future__ import annotations

from service.server import main

main()
