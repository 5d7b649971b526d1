"""Who may open the node's web page and its JSON endpoints (the metrics port).

The rule (docs/security.md, docs/operations.md):

- Auth off (no ``tenants_file``): the page and ``/api/*`` are open, like the
  Stats and ListBlocks RPCs are then (anyone may claim any tenant anyway).
- Auth on: the page and ``/api/*`` show every tenant's prefix runs, so they
  need the admin token. No ``admin_token`` configured means no page (403).
  Accepted credentials:

  - ``Authorization: Bearer <admin token>`` (scripts, ``curl``);
  - the session cookie the login form sets: a browser opens ``/``, gets a
    password form, POSTs the token to ``/login`` (in the body, never in a
    URL, so it stays out of history, proxy and access logs) and is
    redirected back with an ``HttpOnly; SameSite=Strict`` cookie. The cookie
    holds its expiry and HMAC-SHA256(admin_token, expiry), not the token: it
    opens the page only, never the admin RPCs, changing the token revokes it,
    and it lapses after ``web_session_seconds`` (8 hours by default; a
    shorter setting also cuts cookies issued before it).
  - Failed sign-ins are slowed per client address (`LoginThrottle`): after
    `FREE_FAILURES` wrong tokens, the address waits 1 s, then 2 s, 4 s, ...
    (at most `MAX_DELAY`) between attempts; an attempt made while it must
    wait is answered 429 with ``Retry-After`` without reading the token.

- ``/metrics`` stays open for scrapers in both modes: it carries counts per
  namespace, model and tenant name, never hashes or prefixes.

Nothing here logs a token, a cookie or a request body.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qs
from wsgiref.types import WSGIEnvironment

COOKIE = "kvstore_web"
"""Name of the page's session cookie."""

MAX_LOGIN_BYTES = 4096
"""Largest login form body read."""

_SESSION_CONTEXT = b"kvstore web session v2"
"""Mixed into the cookie's HMAC (v1 cookies, which never expired, no longer open the page)."""

FREE_FAILURES = 5
"""Failed sign-ins an address may make before it is slowed."""

BASE_DELAY = 1.0
"""Seconds the first slowed attempt waits (doubling with each further failure)."""

MAX_DELAY = 300.0
"""Longest wait between two sign-ins of one address."""

FORGET_SECONDS = 3600.0
"""An address with no failed sign-in for this long starts afresh."""

MAX_ADDRESSES = 10_000
"""Addresses remembered at once (the least recently failing are forgotten first)."""


@dataclass(slots=True)
class _Failures:
    count: int
    last: float


class LoginThrottle:
    """Failed sign-ins per client address, and how long each must wait before the next.

    Bounded (`MAX_ADDRESSES`); the web server runs a thread per request, so
    a lock guards the bookkeeping. ``clock`` is monotonic seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: OrderedDict[str, _Failures] = OrderedDict()

    def wait(self, address: str) -> float:
        """Seconds ``address`` must wait before its next sign-in is checked (0.0: now)."""
        with self._lock:
            record = self._failures.get(address)
            if record is None:
                return 0.0
            now = self._clock()
            if now - record.last > FORGET_SECONDS:
                del self._failures[address]
                return 0.0
            return max(0.0, record.last + _delay(record.count) - now)

    def failed(self, address: str) -> None:
        """Count a wrong token from ``address``."""
        with self._lock:
            now = self._clock()
            record = self._failures.pop(address, None)
            if record is None or now - record.last > FORGET_SECONDS:
                record = _Failures(0, now)
            record.count += 1
            record.last = now
            self._failures[address] = record  # the most recent last
            while len(self._failures) > MAX_ADDRESSES:
                self._failures.popitem(last=False)

    def succeeded(self, address: str) -> None:
        """Forget ``address``'s failures (it signed in)."""
        with self._lock:
            self._failures.pop(address, None)


def _delay(failures: int) -> float:
    """The wait after ``failures`` failed sign-ins in a row."""
    if failures < FREE_FAILURES:
        return 0.0
    return min(MAX_DELAY, BASE_DELAY * 2.0 ** min(failures - FREE_FAILURES, 32))


class Verdict(Enum):
    """What a request to the page or /api/* may do."""

    OPEN = "open"
    """Authorised (or no auth needed)."""
    MISSING = "missing"
    """No credentials: 401, with the login form for the page."""
    WRONG = "wrong"
    """Wrong credentials: 403."""
    DISABLED = "disabled"
    """Auth on and no admin token configured: the page is off (403)."""


@dataclass(frozen=True, slots=True)
class WebAccess:
    """The page's access rule for one node."""

    auth_on: bool
    """A tenants file is configured."""
    admin_token: str
    """The node's admin token ('' = none)."""
    session_seconds: float = 8 * 3600.0
    """Lifetime of a sign-in cookie (``web_session_seconds``)."""
    clock: Callable[[], float] = time.time
    """Wall-clock seconds (a cookie's expiry must mean the same after a restart)."""
    throttle: LoginThrottle = field(default_factory=LoginThrottle)
    """Failed sign-ins per address."""

    def session(self, expires: int) -> str:
        """The cookie value of a session that ends at ``expires`` (Unix seconds)."""
        mac = hmac.new(
            self.admin_token.encode(), _SESSION_CONTEXT + str(expires).encode(), hashlib.sha256
        )
        return f"{expires}.{mac.hexdigest()}"

    def check(self, environ: WSGIEnvironment) -> Verdict:
        """The verdict for a request's credentials (header or cookie)."""
        if not self.auth_on:
            return Verdict.OPEN
        if not self.admin_token:
            return Verdict.DISABLED
        header = environ.get("HTTP_AUTHORIZATION", "")
        if header:
            scheme, _, token = header.partition(" ")
            ok = scheme.lower() == "bearer" and self.token_ok(token.strip())
            return Verdict.OPEN if ok else Verdict.WRONG
        cookie = _cookie(environ.get("HTTP_COOKIE", ""))
        if cookie is None:
            return Verdict.MISSING
        return Verdict.OPEN if self.session_ok(cookie) else Verdict.WRONG

    def session_ok(self, cookie: str) -> bool:
        """Whether ``cookie`` is a session this node issued that has not ended."""
        expires, _, _ = cookie.partition(".")
        if not expires.isdigit() or len(expires) > 12:
            return False
        if not hmac.compare_digest(cookie.encode(), self.session(int(expires)).encode()):
            return False
        now = self.clock()
        # A later expiry than a session issued now could have: issued under a longer
        # web_session_seconds, cut to the current one.
        return now < int(expires) <= now + self.session_seconds + 1

    def token_ok(self, token: str) -> bool:
        """Whether ``token`` is the admin token (constant time)."""
        return bool(self.admin_token) and hmac.compare_digest(
            token.encode(), self.admin_token.encode()
        )

    def login_wait(self, environ: WSGIEnvironment) -> float:
        """Seconds the caller's address must wait before a sign-in is checked (0.0: now)."""
        return self.throttle.wait(_address(environ))

    def login(self, environ: WSGIEnvironment) -> bool:
        """Whether a POST /login body (``token=...``) carries the admin token.

        A wrong token counts against the caller's address (`LoginThrottle`).
        """
        if not self.auth_on or not self.admin_token:
            return False
        try:
            length = min(int(environ.get("CONTENT_LENGTH") or 0), MAX_LOGIN_BYTES)
        except ValueError:
            length = 0
        body = environ["wsgi.input"].read(length) if length > 0 else b""
        token = parse_qs(body.decode(errors="replace")).get("token", [""])[0]
        ok = self.token_ok(token)
        if ok:
            self.throttle.succeeded(_address(environ))
        else:
            self.throttle.failed(_address(environ))
        return ok

    def cookie_header(self, secure: bool) -> tuple[str, str]:
        """The Set-Cookie header of a successful login (ends in ``session_seconds``)."""
        max_age = int(self.session_seconds)
        expires = int(self.clock()) + max_age
        flags = f"Path=/; Max-Age={max_age}; HttpOnly; SameSite=Strict" + (
            "; Secure" if secure else ""
        )
        return ("Set-Cookie", f"{COOKIE}={self.session(expires)}; {flags}")


def _address(environ: WSGIEnvironment) -> str:
    """The client's address as the web server saw it (a proxy's, behind one)."""
    return str(environ.get("REMOTE_ADDR", ""))


def _cookie(header: str) -> str | None:
    try:
        jar = SimpleCookie(header)
    except CookieError:
        return None
    morsel = jar.get(COOKIE)
    return morsel.value if morsel is not None else None


LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvstore node: sign in</title>
<style>body{font:14px system-ui,sans-serif;margin:40px;color:#222}
input{font:inherit;padding:4px 6px;width:24em}button{font:inherit;padding:4px 10px}
.err{color:#b00}</style></head>
<body><h1>kvstore node</h1>
<p>This node has auth on: its page shows every tenant's cached prefixes and needs the
admin token (<code>admin_token</code> / <code>KVSTORE_ADMIN_TOKEN</code>).</p>
<p class="err">%(message)s</p>
<form method="post" action="/login">
<input type="password" name="token" autocomplete="current-password" placeholder="admin token"
autofocus> <button type="submit">Open</button></form></body></html>
"""
"""The page a browser gets instead of the node's page until it signs in."""

DISABLED_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvstore node</title></head>
<body style="font:14px system-ui,sans-serif;margin:40px"><h1>kvstore node</h1>
<p>This node has auth on and no admin token, so its web page is off: it would show every
tenant's cached prefixes. Set <code>admin_token</code> (<code>KVSTORE_ADMIN_TOKEN</code>)
to open it with that token. <code>/metrics</code> is served as usual.</p></body></html>
"""
