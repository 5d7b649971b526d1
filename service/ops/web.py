"""The node's read-only web page and its JSON endpoints, on the metrics port.

Routes:

- ``GET /`` — one HTML page (``service/ops/web/index.html``, no external
  assets: the page must work offline) that polls the endpoints below and
  draws namespaces by model with their tenants, hit rate over time and the
  prefix tree as SVG.
- ``GET /api/stats`` — `kvstore.ops.summary.status_json` plus ``history``,
  the hit-rate samples the node keeps (`HitRateHistory`), and ``tenants``
  (`kvstore.ops.summary.tenants_json` rows).
- ``GET /api/tree?namespace=NS&max_blocks=N`` — the namespace's prefix tree
  collapsed into runs (`kvstore.ops.prefix_tree`), the ``kvstore tree`` JSON,
  plus ``namespaces``; NS is an id, a model id or a unique prefix of either
  (`kvstore.ops.names`); no namespace = the busiest one (most tokens looked up).
- ``POST /login`` — the page's sign-in form when auth is on (`web_auth`).
- ``POST /query`` — the routers' prefix query as JSON (`service.ops.query_http`;
  its own auth: a tenant's or the admin's token, not the page's).
- ``GET /metrics`` — the Prometheus exposition, open to scrapers.
- anything else — 404 (a JSON error under ``/api/``).

With auth on, the page and ``/api/*`` need the admin token (`web_auth`).

The HTTP server runs in a thread; the store is driven by the event loop and
has no lock, so every read of it hops onto the loop (`on_loop`), like
`Node.snapshot`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import threading
from collections.abc import Callable, Iterable
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs
from wsgiref.types import StartResponse, WSGIEnvironment

from kvstore.block import BlockState
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.ops.names import resolve_namespace
from kvstore.ops.prefix_tree import BlockRecord, build_tree, tree_json
from kvstore.ops.summary import status_json, tenants_json
from kvstore.types import NamespaceId
from service.node import Node
from service.ops import query_http
from service.ops.metrics import WsgiApp
from service.ops.web_auth import DISABLED_PAGE, LOGIN_PAGE, Verdict, WebAccess

log = logging.getLogger(__name__)

T = TypeVar("T")

HISTORY_SAMPLES = 360
"""Hit-rate samples kept (30 minutes at the default 5 s interval)."""

TREE_MAX_BLOCKS = 20000
"""Most blocks one /api/tree request reads from the store (it runs on the loop)."""

PAGE = Path(__file__).with_name("web") / "index.html"


class HitRateHistory:
    """A ring buffer of cumulative lookup counters, sampled by the node.

    Samples are appended on the event loop and read by the HTTP thread; the
    lock guards only the deque.
    """

    def __init__(self, maxlen: int = HISTORY_SAMPLES) -> None:
        self._samples: collections.deque[dict[str, float]] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def add(self, at: float, status: dict[str, Any]) -> None:
        """Record one sample: the interval's hit rate in tokens, from the cumulative counts."""
        hit, miss = float(status["hit_tokens"]), float(status["miss_tokens"])
        with self._lock:
            prev = self._samples[-1] if self._samples else None
            d_hit = hit - prev["hit_tokens"] if prev else hit
            d_miss = miss - prev["miss_tokens"] if prev else miss
            if d_hit < 0 or d_miss < 0:  # a namespace went away: restart the deltas
                d_hit, d_miss = hit, miss
            self._samples.append(
                {
                    "at": at,
                    "hit_tokens": hit,
                    "miss_tokens": miss,
                    "lookup_tokens": d_hit + d_miss,
                    "hit_rate_tokens": d_hit / (d_hit + d_miss) if d_hit + d_miss else -1.0,
                    "used_blocks": float(status["used_blocks"]),
                    "capacity_blocks": float(status["capacity_blocks"]),
                }
            )

    def samples(self) -> list[dict[str, float]]:
        """A copy of the samples, oldest first (hit_rate_tokens -1: no lookups then)."""
        with self._lock:
            return list(self._samples)


async def sample_forever(node: Node, history: HitRateHistory, interval: float) -> None:
    """Append a sample to ``history`` every ``interval`` seconds (a task on the loop)."""
    while True:
        try:
            history.add(node.wall(), status_json(node.stats_response()))
        except Exception:
            log.exception("bug: hit-rate sampling failed")
        await asyncio.sleep(interval)


def on_loop(node: Node, fn: Callable[[], T], timeout: float = 5.0) -> T:
    """Run ``fn`` on the node's event loop from another thread and return its result."""
    loop = node.loop
    if loop is None or not loop.is_running() or _running_loop() is loop:
        return fn()

    async def call() -> T:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=timeout)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _records(node: Node, namespace: NamespaceId, limit: int) -> tuple[int, list[BlockRecord]]:
    """(total blocks, up to ``limit`` records) of a namespace; call on the loop."""
    total = len(node.table(namespace))
    index = node.engine_index
    records = [
        BlockRecord(
            hash=info.hash,
            parent=info.parent or b"",
            depth=info.depth,
            hits=info.hits,
            pins=info.refcount,
            tenant=info.scope,
            writing=info.state is BlockState.WRITING,
            engines=tuple(index.holders(namespace, info.scope, info.hash)) if index else (),
        )
        for info in islice(node.store.iter_blocks(namespace), limit)
    ]
    return total, records


class BadRequest(ValueError):
    """A malformed query parameter (answered 400)."""


class WebApp:
    """WSGI app: the page, the JSON endpoints, /metrics, 404 for the rest."""

    def __init__(
        self, node: Node, history: HitRateHistory, metrics: WsgiApp, access: WebAccess | None = None
    ) -> None:
        self.node = node
        self.history = history
        self.metrics = metrics
        self.access = access or WebAccess(
            auth_on=node.tenants.auth_on,
            admin_token=node.config.admin_token,
            session_seconds=node.config.web_session_seconds,
        )

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        method = environ.get("REQUEST_METHOD", "GET")
        if path == "/metrics":
            return self.metrics(environ, start_response)
        if path == "/login":
            return self._login(environ, start_response, method)
        if path == "/query":
            return self._query(environ, start_response, method)
        page = path in ("/", "/index.html")
        api = path.startswith("/api/")
        if not page and not api:
            return _reply(start_response, "404 Not Found", b"not found\n", "text/plain")
        if method not in ("GET", "HEAD"):
            return _json(start_response, "405 Method Not Allowed", {"error": "GET only"})
        verdict = self.access.check(environ)
        if verdict is not Verdict.OPEN:
            return self._refuse(start_response, verdict, page)
        try:  # logs name the path only: a query string is the caller's data
            if page:
                return _reply(start_response, "200 OK", PAGE.read_bytes(), "text/html")
            query = parse_qs(environ.get("QUERY_STRING", ""))
            if path == "/api/stats":
                return _json(start_response, "200 OK", self.stats())
            if path == "/api/tree":
                name = query.get("namespace", [""])[0]
                limit = _int(query.get("max_blocks", [""])[0], TREE_MAX_BLOCKS)
                return _json(start_response, "200 OK", self.tree(name, limit))
            return _json(start_response, "404 Not Found", {"error": f"no such path {path}"})
        except (BadRequest, InvalidArgument) as exc:
            return _json(start_response, "400 Bad Request", {"error": str(exc)})
        except KVStoreError as exc:  # UnknownNamespace (the model-id resolver's errors too)
            return _json(start_response, "404 Not Found", {"error": str(exc)})
        except Exception as exc:  # the page must answer, whatever the node is doing
            log.exception("web request %s failed", path)
            return _json(start_response, "503 Service Unavailable", {"error": repr(exc)})

    def _query(self, environ: WSGIEnvironment, start: StartResponse, method: str) -> list[bytes]:
        if method != "POST":
            return _json(start, "405 Method Not Allowed", {"error": "POST a JSON body"})
        try:
            status, doc = query_http.handle(self.node, environ)
        except Exception as exc:  # a router must get an answer, whatever the node is doing
            log.exception("web request /query failed")
            return _json(start, "503 Service Unavailable", {"error": repr(exc)})
        extra = [("WWW-Authenticate", "Bearer")] if status.startswith("401") else None
        if status.startswith("503"):  # the node cannot answer now: a router may retry
            extra = [("Retry-After", str(query_http.RETRY_AFTER_SECONDS))]
        return _json(start, status, doc, extra)

    def _refuse(self, start: StartResponse, verdict: Verdict, page: bool) -> list[bytes]:
        if verdict is Verdict.DISABLED:
            message = "auth is on and this node has no admin token: the web page is off"
            if page:
                return _reply(start, "403 Forbidden", DISABLED_PAGE.encode(), "text/html")
            return _json(start, "403 Forbidden", {"error": message})
        status = "401 Unauthorized" if verdict is Verdict.MISSING else "403 Forbidden"
        if page:
            text = "" if verdict is Verdict.MISSING else "That is not the admin token."
            body = (LOGIN_PAGE % {"message": text}).encode()
            return _reply(start, status, body, "text/html")
        error = (
            "this node has auth on: send 'Authorization: Bearer <admin token>'"
            if verdict is Verdict.MISSING
            else "the admin token is not valid"
        )
        return _json(start, status, {"error": error}, [("WWW-Authenticate", "Bearer")])

    def _login(self, environ: WSGIEnvironment, start: StartResponse, method: str) -> list[bytes]:
        if method != "POST":
            return _reply(start, "405 Method Not Allowed", b"POST the form\n", "text/plain")
        if not self.access.auth_on:
            return _redirect(start, [])
        if not self.access.admin_token:
            return _reply(start, "403 Forbidden", DISABLED_PAGE.encode(), "text/html")
        wait = self.access.login_wait(environ)
        if wait > 0:  # repeated wrong tokens from this address: not even checked
            retry = str(max(1, math.ceil(wait)))
            body = (LOGIN_PAGE % {"message": f"Too many wrong tokens: wait {retry} s."}).encode()
            return _reply(
                start, "429 Too Many Requests", body, "text/html", [("Retry-After", retry)]
            )
        if not self.access.login(environ):
            log.warning("web page: a sign-in with a wrong token")
            body = (LOGIN_PAGE % {"message": "That is not the admin token."}).encode()
            return _reply(start, "403 Forbidden", body, "text/html")
        secure = environ.get("wsgi.url_scheme") == "https"
        return _redirect(start, [self.access.cookie_header(secure)])

    def stats(self) -> dict[str, Any]:
        """The /api/stats document."""
        response = on_loop(self.node, self.node.stats_response)
        doc = status_json(response)
        doc["tenants"] = tenants_json(response)
        doc["history"] = self.history.samples()
        return doc

    def tree(self, namespace: str, limit: int) -> dict[str, Any]:
        """The /api/tree document ("" = the busiest namespace; empty tree when none).

        Raises:
            UnknownNamespace: nothing is named so, by id, model id or a unique
                prefix (`kvstore.ops.names`; answered 404; ambiguous: 400).
        """
        node = self.node

        def read() -> tuple[str, int, int, list[BlockRecord], list[str]]:
            tables = node.store.tables()
            names: list[str] = [t.spec.namespace_id for t in tables]
            pairs = [(t.spec.namespace_id, t.spec.model_id) for t in tables]
            ns = NamespaceId(resolve_namespace(namespace, pairs)) if namespace else busiest(node)
            if ns is None:
                return "", 0, 0, [], names
            total, records = _records(node, ns, limit)
            return ns, node.table(ns).block_size, total, records, names

        ns, block_size, total, records, names = on_loop(node, read)
        roots = build_tree(records, block_size)
        doc = tree_json(ns, block_size, roots, len(records), total)
        doc["namespaces"] = names
        return doc


def busiest(node: Node) -> NamespaceId | None:
    """The namespace with the most tokens looked up (then most blocks used); call on the loop."""
    best: tuple[int, int] | None = None
    found: NamespaceId | None = None
    for ns in node.store.stats().namespaces:
        lookups = sum(c.hit_tokens + c.miss_tokens for c in ns.tenants.values())
        key = (lookups, ns.ready + ns.writing)
        if best is None or key > best:
            best, found = key, ns.namespace
    return found


def _int(text: str, default: int) -> int:
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise BadRequest(f"max_blocks must be a whole number, got {text[:32]!r}") from None
    if value < 1:
        raise BadRequest(f"max_blocks must be at least 1, got {value}")
    return min(value, 10 * TREE_MAX_BLOCKS)


def _reply(
    start: StartResponse,
    status: str,
    body: bytes,
    ctype: str,
    extra: list[tuple[str, str]] | None = None,
) -> list[bytes]:
    start(
        status,
        [
            ("Content-Type", f"{ctype}; charset=utf-8"),
            ("Content-Length", str(len(body))),
            ("Cache-Control", "no-store"),
            ("X-Content-Type-Options", "nosniff"),
            ("Referrer-Policy", "no-referrer"),
            ("X-Frame-Options", "DENY"),
            *(extra or []),
        ],
    )
    return [body]


def _json(
    start: StartResponse, status: str, doc: object, extra: list[tuple[str, str]] | None = None
) -> list[bytes]:
    return _reply(start, status, json.dumps(doc).encode(), "application/json", extra)


def _redirect(start: StartResponse, headers: list[tuple[str, str]]) -> list[bytes]:
    start("303 See Other", [("Location", "/"), ("Content-Length", "0"), *headers])
    return [b""]
