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
    holds HMAC-SHA256(admin_token, ...), not the token: it opens the page
    only, never the admin RPCs, and changing the token revokes it.

- ``/metrics`` stays open for scrapers in both modes: it carries counts per
  namespace, model and tenant name, never hashes or prefixes.

Nothing here logs a token, a cookie or a request body.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from enum import Enum
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs

COOKIE = "kvstore_web"
"""Name of the page's session cookie."""

MAX_LOGIN_BYTES = 4096
"""Largest login form body read."""

_SESSION_CONTEXT = b"kvstore web session v1"


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

    @property
    def session(self) -> str:
        """The cookie value a valid login sets (derived from the admin token)."""
        return hmac.new(self.admin_token.encode(), _SESSION_CONTEXT, hashlib.sha256).hexdigest()

    def check(self, environ: dict[str, Any]) -> Verdict:
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
        ok = hmac.compare_digest(cookie.encode(), self.session.encode())
        return Verdict.OPEN if ok else Verdict.WRONG

    def token_ok(self, token: str) -> bool:
        """Whether ``token`` is the admin token (constant time)."""
        return bool(self.admin_token) and hmac.compare_digest(
            token.encode(), self.admin_token.encode()
        )

    def login(self, environ: dict[str, Any]) -> bool:
        """Whether a POST /login body (``token=...``) carries the admin token."""
        if not self.auth_on or not self.admin_token:
            return False
        try:
            length = min(int(environ.get("CONTENT_LENGTH") or 0), MAX_LOGIN_BYTES)
        except ValueError:
            return False
        body = environ["wsgi.input"].read(length) if length > 0 else b""
        token = parse_qs(body.decode(errors="replace")).get("token", [""])[0]
        return self.token_ok(token)

    def cookie_header(self, secure: bool) -> tuple[str, str]:
        """The Set-Cookie header of a successful login."""
        flags = "Path=/; HttpOnly; SameSite=Strict" + ("; Secure" if secure else "")
        return ("Set-Cookie", f"{COOKIE}={self.session}; {flags}")


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
