"""The ``engine_kv_events`` setting: the serving engines whose KV events a node ingests.

Each source names one engine (a vLLM instance started with
``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``),
the ZMQ endpoint its events are published on, optionally its replay
endpoint, and the model (namespace) its blocks belong to. Given as a JSON
list in a flag or environment variable, or as an array of tables in a TOML
config file::

    engine_kv_events = [
      {name = "vllm-0", endpoint = "tcp://127.0.0.1:5557",
       replay_endpoint = "tcp://127.0.0.1:5558", model_id = "Qwen/Qwen3-0.6B"},
    ]

See docs/events.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

ENGINE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
"""Engine names: they become part of Redis keys and hash fields."""

_KNOWN = {"name", "endpoint", "replay_endpoint", "model_id", "tenant", "topic"}


@dataclass(frozen=True, slots=True)
class EngineSource:
    """One engine whose KV events the node subscribes to."""

    name: str
    """Engine name, unique on the node ([A-Za-z0-9._-], at most 64 characters)."""
    endpoint: str
    """ZMQ endpoint the engine publishes on (``tcp://host:5557``); the node connects."""
    model_id: str
    """Model whose namespace (registered on this node) the engine's blocks belong to."""
    replay_endpoint: str = ""
    """The engine's replay ROUTER endpoint; empty = gaps are counted, not replayed."""
    tenant: str = "default"
    """Tenant whose chain root the engine's blocks hash from (shared namespaces: none)."""
    topic: str = ""
    """ZMQ topic to subscribe to ("" = every topic)."""


def parse_engine_sources(value: object) -> tuple[EngineSource, ...]:
    """Sources from a JSON string or a list of mappings (a TOML array of tables).

    Raises:
        ValueError: not a list of objects, an unknown or missing key, a bad
            engine name, or the same name twice.
    """
    if isinstance(value, str):
        if not value.strip():
            return ()
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"expected a JSON list of engine objects: {exc}") from None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list of engine objects, got {type(value).__name__}")
    sources: list[EngineSource] = []
    for i, item in enumerate(value):
        if isinstance(item, EngineSource):
            sources.append(item)
            continue
        if not isinstance(item, dict):
            raise ValueError(f"engine {i} must be an object, got {type(item).__name__}")
        unknown = sorted(set(item) - _KNOWN)
        if unknown:
            raise ValueError(f"engine {i}: unknown keys {unknown} (known: {sorted(_KNOWN)})")
        for key in ("name", "endpoint", "model_id"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise ValueError(f"engine {i}: {key!r} is required (a non-empty string)")
        for key in ("replay_endpoint", "tenant", "topic"):
            if key in item and not isinstance(item[key], str):
                raise ValueError(f"engine {i}: {key!r} must be a string")
        if not ENGINE_NAME.match(item["name"]):
            raise ValueError(
                f"engine {i}: name {item['name']!r} must be 1-64 characters of [A-Za-z0-9._-]"
            )
        sources.append(EngineSource(**item))
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"engine names must be unique, got {twice} more than once")
    return tuple(sources)
