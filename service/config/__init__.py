"""The server's configuration: one schema read from flags, environment and a file.

- `schema`: the `Config` dataclass, `load_config` (precedence) and `resolve`.
- `values`: the parsers of one setting's text (sizes, booleans, modes, ...).
- `docs`: docs/config.md generated from the schema (``python -m service.config.docs``).
"""

from __future__ import annotations

from service.config.schema import (
    Config,
    ConfigError,
    default_node_id,
    load_config,
    read_setting_file,
    resolve,
)

__all__ = [
    "Config",
    "ConfigError",
    "default_node_id",
    "load_config",
    "read_setting_file",
    "resolve",
]
