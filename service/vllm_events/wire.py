"""vLLM's KV-event wire format: msgpack batches of BlockStored / BlockRemoved / AllBlocksCleared.

What vLLM's ``ZmqEventPublisher`` sends (vllm/distributed/kv_events.py), and
what routers built on it (llm-d's KV-cache indexer, Dynamo's KV router)
decode. One ZMQ message is three frames::

    [topic, sequence (8 bytes, big-endian, unsigned), payload]

The payload is a ``KVEventBatch``, a msgspec ``array_like`` struct::

    [ts (unix seconds, float), [event, ...], data_parallel_rank (int or nil)]

Each event is encoded one of two ways, both in the wild:

- a tagged map (vLLM >= 0.10; the default here)::

      {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h or nil,
       "token_ids": [...], "block_size": n, "lora_id": nil, "medium": "GPU",
       "lora_name": nil, ...}
      {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", ...}
      {"type": "AllBlocksCleared"}

- a tag-first array (older vLLM, whose events were ``array_like`` too), the
  fields in declaration order: ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
  extra_keys, group_idx, ...]``, ``["BlockRemoved", block_hashes, medium,
  group_idx, ...]``, ``["AllBlocksCleared"]``. Missing trailing fields are nil.

The batch itself may also come as a map (``{"ts", "events",
"data_parallel_rank"}``). A block hash (vLLM's ``ExternalBlockHash``) is
bytes (SHA-256 digests, vLLM's default) or an int (with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); both are accepted as opaque keys.

msgpack is imported on first use: it comes with the ``events`` extra.
"""

from __future__ import annotations

import importlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.extras import MissingExtra

EngineHash = bytes | int
"""A block hash as an engine publishes it (vLLM's ``ExternalBlockHash``)."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame a replay ends with (its topic and payload frames are empty)."""

MAX_PAYLOAD_BYTES = 64 << 20
"""Largest batch payload decoded; a larger one is refused as malformed."""

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class WireError(ValueError):
    """A payload that is not a KV-event batch this decoder understands."""


@dataclass(frozen=True, slots=True)
class Stored:
    """BlockStored: full blocks an engine cached, in chain order."""

    block_hashes: tuple[EngineHash, ...]
    parent: EngineHash | None
    """The engine's hash of the block before the first one (None: a chain start)."""
    token_ids: array[int]
    """Every token of the blocks (block_size per block); may be empty from a publisher
    that does not know them (this node's own events)."""
    block_size: int
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None
    """Per block, what else went into its hash (LoRA, multimodal, cache salt), or None."""
    group_idx: int | None


@dataclass(frozen=True, slots=True)
class Removed:
    """BlockRemoved: blocks an engine evicted from one medium."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None
    group_idx: int | None


@dataclass(frozen=True, slots=True)
class Cleared:
    """AllBlocksCleared: the engine dropped every block (a reset)."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    """One KVEventBatch."""

    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


def _msgpack() -> Any:
    try:
        return importlib.import_module("msgpack")
    except ImportError as exc:
        raise MissingExtra(
            "vLLM KV events need msgpack and pyzmq: pip install 'kvstore[events]'"
        ) from exc


# --- encoding ---------------------------------------------------------------------


def stored(
    hashes: Sequence[bytes], parent: bytes | None, block_size: int, medium: str, *, array: bool
) -> Any:
    """A BlockStored event (no token ids: a cache node keys blocks by hash only)."""
    values: list[Any] = [list(hashes), parent, [], block_size, None, medium, None]
    if array:
        return ["BlockStored", *values]
    return {"type": "BlockStored", **dict(zip(_STORED_FIELDS, values, strict=False))}


def removed(hashes: Sequence[bytes], medium: str, *, array: bool) -> Any:
    """A BlockRemoved event."""
    if array:
        return ["BlockRemoved", list(hashes), medium]
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def encode_batch(ts: float, events: Sequence[Any], dp_rank: int | None = None) -> bytes:
    """The payload of one batch of events made by `stored` / `removed`."""
    packed: bytes = _msgpack().packb([ts, list(events), dp_rank], use_bin_type=True)
    return packed


def seq_bytes(seq: int) -> bytes:
    """The sequence frame of batch number ``seq``."""
    return seq.to_bytes(8, "big")


# --- decoding ---------------------------------------------------------------------


def decode_batch(payload: bytes) -> Batch:
    """Decode one payload, in either encoding.

    Raises:
        WireError: not msgpack, not a batch, or an event with a field of the
            wrong type. Events of a type this decoder does not know are skipped
            (a newer publisher may add some).
    """
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise WireError(f"payload of {len(payload)} bytes is over {MAX_PAYLOAD_BYTES}")
    msgpack = _msgpack()
    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"not msgpack: {exc}") from None
    if isinstance(doc, dict):
        ts, events, rank = doc.get("ts"), doc.get("events"), doc.get("data_parallel_rank")
    elif isinstance(doc, list) and len(doc) >= 2:
        ts, events = doc[0], doc[1]
        rank = doc[2] if len(doc) > 2 else None
    else:
        raise WireError(f"a batch is [ts, events, rank] or a map, got {type(doc).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise WireError(f"batch ts must be a number, got {ts!r:.40}")
    if not isinstance(events, list):
        raise WireError("batch events must be a list")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise WireError(f"data_parallel_rank must be an int or nil, got {rank!r:.40}")
    decoded = [e for e in (_event(raw) for raw in events) if e is not None]
    return Batch(float(ts), tuple(decoded), rank)


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(tag, ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise WireError(f"an event is a tagged map or a tag-first array, got {raw!r:.60}")
    if tag == "BlockStored":
        return Stored(
            block_hashes=_hashes(fields.get("block_hashes")),
            parent=_hash_or_none(fields.get("parent_block_hash")),
            token_ids=_tokens(fields.get("token_ids")),
            block_size=_positive(fields.get("block_size"), "block_size"),
            medium=_str_or_none(fields.get("medium"), "medium"),
            lora_name=_str_or_none(fields.get("lora_name"), "lora_name"),
            extra_keys=_extra_keys(fields.get("extra_keys")),
            group_idx=_int_or_none(fields.get("group_idx"), "group_idx"),
        )
    if tag == "BlockRemoved":
        return Removed(
            block_hashes=_hashes(fields.get("block_hashes")),
            medium=_str_or_none(fields.get("medium"), "medium"),
            group_idx=_int_or_none(fields.get("group_idx"), "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return Cleared()
    if not isinstance(tag, str):
        raise WireError(f"event type must be a string, got {tag!r:.40}")
    return None  # a type from a newer publisher


def _is_hash(value: Any) -> bool:
    return isinstance(value, bytes) or (isinstance(value, int) and not isinstance(value, bool))


def _hashes(value: Any) -> tuple[EngineHash, ...]:
    if not isinstance(value, list) or not all(_is_hash(h) for h in value):
        raise WireError("block_hashes must be a list of bytes or ints")
    return tuple(value)


def _hash_or_none(value: Any) -> EngineHash | None:
    if value is None or _is_hash(value):
        return value  # type: ignore[no-any-return]
    raise WireError(f"parent_block_hash must be bytes, an int or nil, got {value!r:.40}")


def _tokens(value: Any) -> array[int]:
    """Token ids as uint32, checked in C (a per-item check in Python was 80% of an ingest)."""
    if not isinstance(value, list):
        raise WireError("token_ids must be a list of ints")
    try:
        return array("I", value)
    except (TypeError, OverflowError):
        raise WireError("token_ids must be a list of ints in [0, 2**32)") from None


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise WireError(f"{name} must be a positive int, got {value!r:.40}")
    return value


def _int_or_none(value: Any, name: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise WireError(f"{name} must be an int or nil, got {value!r:.40}")


def _str_or_none(value: Any, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise WireError(f"{name} must be a string or nil, got {value!r:.40}")


def _extra_keys(value: Any) -> tuple[Any, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise WireError("extra_keys must be a list or nil")
    return tuple(value)
