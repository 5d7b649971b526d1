"""``POST /query`` on the node's HTTP port: the routers' prefix query as JSON.

The body is a JSON object shaped like Mooncake Conductor's ``/query``
(docs/cluster.md, "Prefix query for routers"):

    {"model": "M", "tenant_id": "t", "token_ids": [1, 2, ...]}

with ``namespace_id`` in place of ``model``, ``block_hashes`` (64 hex digits
each) in place of ``token_ids``, and optionally ``extras`` (hex, one per
block, with token_ids), ``block_size`` (checked against the namespace's) and
``lora_name`` (must be empty: a LoRA is part of the model id or of the
extras here). Any other key is refused, so a misspelt one is not silently
ignored.

Credentials are the gRPC call's, as headers: ``Authorization: Bearer
<token>`` (a tenant's or the admin's, `prefix_query.query_tenant`), or with
auth off ``X-Kvstore-Tenant``. Answers: 200 with the answer; 400 bad input;
401 no or unknown token; 403 another tenant or a model not allowed; 404 no
such namespace or model here; 413 a body over the bound; 503 the node
cannot answer now (not serving yet, or its event loop did not answer within
`ANSWER_TIMEOUT`), with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Callable, Coroutine
from typing import Any
from wsgiref.types import WSGIEnvironment

from kvstore.api.prefix import PrefixAnswer
from kvstore.errors import InvalidArgument, KVStoreError, NotFound, PermissionDenied
from service.api.errors import FieldError, Unauthenticated, shorten
from service.api.prefix_query import PrefixQuery, answer
from service.node import Node

BODY_BYTES_PER_REQUEST_BYTE = 4
"""A JSON body may be this many times ``max_request_bytes`` (token ids as text are ~4x)."""

ANSWER_TIMEOUT = 30.0
"""Seconds the HTTP thread waits for the loop's answer before a 503."""

RETRY_AFTER_SECONDS = 1
"""The ``Retry-After`` of a 503: the node could not answer now (loop busy, not serving)."""

_KEYS = {
    "model",
    "namespace_id",
    "tenant_id",
    "token_ids",
    "block_hashes",
    "extras",
    "block_size",
    "lora_name",
}
"""Keys a request may carry."""

_MAX_TOKEN = (1 << 32) - 1


class TooLarge(ValueError):
    """The body is over the bound (answered 413)."""


def parse_body(body: bytes) -> tuple[PrefixQuery, int]:
    """The query a JSON body asks, and the block size it expects (0: any).

    Raises:
        FieldError: not a JSON object, an unknown key, a value of the wrong type.
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FieldError("body", f"is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise FieldError("body", "must be a JSON object")
    unknown = sorted(set(doc) - _KEYS)
    if unknown:
        raise FieldError(
            unknown[0], f"is not a field of /query (fields: {', '.join(sorted(_KEYS))})"
        )
    if doc.get("lora_name"):
        raise FieldError(
            "lora_name", "is not used here: a LoRA is part of the model id or the extras"
        )
    block_size = doc.get("block_size") or 0
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 0:
        raise FieldError("block_size", "must be a whole number of tokens")
    tokens = doc.get("token_ids") or []
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_TOKEN for t in tokens
    ):
        raise FieldError("token_ids", "must be a list of token ids (0 to 2**32-1)")
    return (
        PrefixQuery(
            model=_string(doc, "model"),
            namespace_id=_string(doc, "namespace_id"),
            tenant_id=_string(doc, "tenant_id"),
            tokens=tokens,
            hashes=_hex_list(doc, "block_hashes"),
            extras=_hex_list(doc, "extras"),
        ),
        block_size,
    )


def _string(doc: dict[str, Any], key: str) -> str:
    value = doc.get(key) or ""
    if not isinstance(value, str):
        raise FieldError(key, "must be a string")
    return value


def _hex_list(doc: dict[str, Any], key: str) -> list[bytes]:
    values = doc.get(key) or []
    if not isinstance(values, list):
        raise FieldError(key, "must be a list of hex strings")
    out = []
    for i, value in enumerate(values):
        try:
            out.append(bytes.fromhex(value))
        except (TypeError, ValueError):
            raise FieldError(key, f"item {i} is not a hex string") from None
    return out


def answer_json(result: PrefixAnswer) -> dict[str, Any]:
    """The JSON of an answer: the holders, and Conductor's per-instance view.

    ``instances`` maps each holder's instance (the node id, or
    ``node/engine`` for an engine) to its ``longest_matched`` tokens and its
    tokens per tier, as Conductor's response maps an instance to
    ``longest_matched`` and its tokens per medium.
    """
    instances: dict[str, dict[str, int]] = {}
    for h in result.holders:
        entry = instances.setdefault(
            f"{h.node_id}/{h.engine}" if h.engine else h.node_id, {"longest_matched": 0}
        )
        entry["longest_matched"] = max(entry["longest_matched"], h.matched_tokens)
        entry[h.tier] = max(entry.get(h.tier, 0), h.matched_tokens)
    return {**result.to_json(), "instances": instances}


def read_body(environ: WSGIEnvironment, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes.

    Raises:
        TooLarge: a longer body, or a chunked one of unknown length.
    """
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise FieldError("Content-Length", "is not a number") from None
    if length > limit:
        raise TooLarge(f"the body is {length} bytes, at most {limit} (max_request_bytes x 4)")
    stream = environ.get("wsgi.input")
    return stream.read(length) if stream is not None and length > 0 else b""


def handle(node: Node, environ: WSGIEnvironment) -> tuple[str, dict[str, Any]]:
    """(HTTP status, JSON document) of one ``POST /query`` (runs in the HTTP thread)."""
    limit = BODY_BYTES_PER_REQUEST_BYTE * node.config.max_request_bytes
    try:
        metadata = [("authorization", environ.get("HTTP_AUTHORIZATION", ""))]
        if "HTTP_X_KVSTORE_TENANT" in environ:
            metadata.append(("x-kvstore-tenant", environ["HTTP_X_KVSTORE_TENANT"]))
        caller = node.tenants.caller(metadata)
        query, block_size = parse_body(read_body(environ, limit))
        result = _on_loop(node, lambda: answer(node, caller, query))
        if block_size and block_size != result.block_size:
            raise FieldError(
                "block_size",
                f"is {block_size}, the namespace's is {result.block_size} (another layout)",
            )
        return "200 OK", answer_json(result)
    except TooLarge as exc:
        return "413 Content Too Large", {"error": str(exc)}
    except Unauthenticated as exc:
        return "401 Unauthorized", {"error": shorten(str(exc))}
    except PermissionDenied as exc:
        return "403 Forbidden", {"error": shorten(str(exc))}
    except InvalidArgument as exc:
        return "400 Bad Request", {"error": shorten(str(exc))}
    except NotFound as exc:
        return "404 Not Found", {"error": shorten(str(exc))}
    except KVStoreError as exc:
        return "503 Service Unavailable", {"error": shorten(str(exc))}


def _on_loop(node: Node, make: Callable[[], Coroutine[object, None, PrefixAnswer]]) -> PrefixAnswer:
    """Await ``make()`` on the node's loop from this (HTTP) thread.

    Raises:
        _NotServing: the loop is not running.
        _LoopBusy: the loop did not answer within `ANSWER_TIMEOUT` (the
            query is cancelled there, so it does not run late for nobody).
    """
    loop = node.loop
    if loop is None or not loop.is_running():
        raise _NotServing("the node is not serving yet")
    future = asyncio.run_coroutine_threadsafe(make(), loop)
    timeout = ANSWER_TIMEOUT
    try:
        result: PrefixAnswer = future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise _LoopBusy(
            f"the node did not answer within {timeout:g} s (its event loop is busy or "
            f"stalled); retry in {RETRY_AFTER_SECONDS} s or ask another node"
        ) from None
    return result


class _NotServing(KVStoreError):
    """The node's loop is not running (answered 503)."""


class _LoopBusy(KVStoreError):
    """The node's loop did not answer in time (answered 503 with ``Retry-After``)."""
