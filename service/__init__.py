"""The kvstore gRPC server: servicers that only translate, bootstrap, config, metrics.

Start one with ``kvstore-server`` (`service.server.main`), ``python -m
service``, or from code with `Server` / `serve`. The names below are
imported lazily, so ``python -m service.config.docs`` runs without importing the
server first.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Config", "ConfigError", "Server", "load_config", "serve"]

_HOMES = {
    "Config": "service.config",
    "ConfigError": "service.config",
    "load_config": "service.config",
    "Server": "service.server",
    "serve": "service.server",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'service' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
