"""With auth on, the web page and its JSON endpoints need the admin token.

``/api/tree`` lists every tenant's prefix runs: open to anyone, a tenant
could confirm another tenant's secret prompt. The page and ``/api/*`` take
``Authorization: Bearer <admin token>`` or the session cookie the sign-in
form sets (the token travels in a POST body, never in a URL or a log line);
``/metrics`` stays open and carries no hashes; unknown paths are 404.
"""

from __future__ import annotations

import io
import json
import logging
import urllib.error
import urllib.request

import pytest

from kvstore.v1 import kvstore_pb2 as pb
from service.ops.web_auth import COOKIE, FREE_FAILURES, LoginThrottle, Verdict, WebAccess
from tests.cli.conftest import ADMIN_TOKEN, start_node, stop_node, store_prompt

TENANT_TOKEN = "alice-web-token-0123456789"


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def populate(node) -> str:
    """Alice caches a 2-block prompt; returns the namespace."""
    md = bearer(TENANT_TOKEN)
    ns = store_prompt(node, "secret-model", list(range(8)), md)
    channel, stub = node.stub()
    with channel:
        stub.Lookup(pb.LookupRequest(namespace_id=ns, tokens=list(range(8))), metadata=md)
    node.namespace = ns
    return ns


def tenants_file(tmp_path) -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.alice]\ntokens = ["{TENANT_TOKEN}"]\nnamespaces = ["*"]\n')
    return str(path)


@pytest.fixture(scope="module")
def auth_node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("web-auth")
    node = start_node(tmp, tenants_file=tenants_file(tmp))
    try:
        populate(node)
        yield node
    finally:
        stop_node(node)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def http(node, path, *, headers=None, data: bytes | None = None):
    """(status, headers, body) of one request; redirects are not followed."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{node.metrics_port}{path}", data=data, headers=headers or {}
    )
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def test_page_and_api_need_the_admin_token(auth_node):
    ns = auth_node.namespace
    for path in ("/api/tree", f"/api/tree?namespace={ns}", "/api/stats", "/api/nothing"):
        status, headers, body = http(auth_node, path)
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer", path
        assert b"alice" not in body and ns.encode() not in body and b"secret-model" not in body
        assert "error" in json.loads(body)
        status, _, body = http(auth_node, path, headers={"Authorization": f"Bearer {TENANT_TOKEN}"})
        assert status == 403 and b"alice" not in body, path  # a tenant's token is not enough
    status, _, body = http(auth_node, "/")
    assert status == 401 and b'action="/login"' in body and b"alice" not in body
    status, _, body = http(auth_node, "/", headers={"Cookie": f"{COOKIE}=forged"})
    assert status == 403 and b'action="/login"' in body

    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    status, _, body = http(auth_node, "/api/tree", headers=admin)
    doc = json.loads(body)
    assert status == 200 and doc["namespace"] == ns and doc["roots"][0]["tenant"] == "alice"
    status, _, body = http(auth_node, "/api/stats", headers=admin)
    assert status == 200 and json.loads(body)["tenants"][0]["tenant"] == "alice"
    assert http(auth_node, "/", headers=admin)[0] == 200


def test_browser_signs_in_with_a_form_and_gets_a_cookie(auth_node, caplog):
    caplog.set_level(logging.DEBUG)
    status, _, body = http(auth_node, "/login", data=b"token=not-the-token")
    assert status == 403 and b"not the admin token" in body
    assert http(auth_node, "/login")[0] == 405  # GET: the token never rides in a URL
    status, headers, _ = http(auth_node, "/login", data=f"token={ADMIN_TOKEN}".encode())
    assert status == 303 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    session = cookie.split(";")[0]
    assert ADMIN_TOKEN not in session  # the cookie is derived, not the token itself
    jar = {"Cookie": session}
    status, _, body = http(auth_node, "/", headers=jar)
    assert status == 200 and b"<svg" in body
    status, _, body = http(auth_node, "/api/tree", headers=jar)
    assert status == 200 and json.loads(body)["roots"][0]["tenant"] == "alice"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert ADMIN_TOKEN not in logged and "not-the-token" not in logged


def test_metrics_stay_open_without_hashes_and_unknown_paths_are_404(auth_node):
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    tree = json.loads(http(auth_node, "/api/tree", headers=admin)[2])
    status, _, body = http(auth_node, "/metrics")
    text = body.decode()
    assert status == 200 and "kvstore_lookup_blocks_total" in text
    run = tree["roots"][0]
    for secret in (run["first_hash"], run["last_hash"], run["first_hash"][:16], TENANT_TOKEN):
        assert secret not in text
    for path in ("/nothing", "/favicon.ico", "/metrics/x", "/index.htm", "/api"):
        assert http(auth_node, path)[0] == 404, path
        assert http(auth_node, path, headers=admin)[0] == 404, path


def test_unknown_namespace_and_bad_parameters_are_clean_json_errors(auth_node):
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    status, headers, body = http(auth_node, "/api/tree?namespace=nope", headers=admin)
    assert status == 404 and headers["Content-Type"].startswith("application/json")
    assert "nope" in json.loads(body)["error"]
    for query in ("max_blocks=abc", "max_blocks=0", "max_blocks=-3"):
        status, _, body = http(auth_node, f"/api/tree?{query}", headers=admin)
        assert status == 400 and "max_blocks" in json.loads(body)["error"], query


def test_auth_on_without_an_admin_token_turns_the_page_off(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.cli.conftest.ADMIN_TOKEN", "")  # start_node's admin token
    node = start_node(tmp_path, tenants_file=tenants_file(tmp_path))
    assert node.server.config.admin_token == ""
    try:
        populate(node)
        for path in ("/", "/api/tree", "/api/stats"):
            status, _, body = http(node, path, headers={"Authorization": "Bearer anything"})
            assert status == 403 and b"alice" not in body, path
        assert http(node, "/login", data=b"token=")[0] == 403
        assert http(node, "/metrics")[0] == 200
    finally:
        stop_node(node)


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def login_environ(token: str, address: str = "10.0.0.7") -> dict:
    body = f"token={token}".encode()
    return {
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
        "REMOTE_ADDR": address,
    }


def test_the_session_cookie_ends_after_web_session_seconds(auth_node):
    status, headers, _ = http(auth_node, "/login", data=f"token={ADMIN_TOKEN}".encode())
    assert status == 303 and "Max-Age=28800" in headers["Set-Cookie"]  # default: 8 hours

    clock = FakeClock()
    access = WebAccess(auth_on=True, admin_token=ADMIN_TOKEN, session_seconds=3600, clock=clock)
    _, set_cookie = access.cookie_header(secure=False)
    assert "Max-Age=3600" in set_cookie
    jar = {"HTTP_COOKIE": set_cookie.split(";")[0]}
    assert access.check(jar) is Verdict.OPEN
    clock.now += 3599
    assert access.check(jar) is Verdict.OPEN
    clock.now += 2
    assert access.check(jar) is Verdict.WRONG  # lapsed: sign in again
    # A shorter lifetime set later also cuts the cookies issued before it.
    clock.now -= 3601
    shorter = WebAccess(auth_on=True, admin_token=ADMIN_TOKEN, session_seconds=60, clock=clock)
    assert shorter.check(jar) is Verdict.WRONG
    # The expiry cannot be edited: it is under the HMAC.
    value = jar["HTTP_COOKIE"].split("=", 1)[1]
    forged = f"{int(value.split('.')[0]) + 10**6}.{value.split('.')[1]}"
    assert access.check({"HTTP_COOKIE": f"{COOKIE}={forged}"}) is Verdict.WRONG


def test_repeated_failed_sign_ins_are_slowed(tmp_path):
    node = start_node(tmp_path, tenants_file=tenants_file(tmp_path))
    try:
        for _ in range(FREE_FAILURES):
            assert http(node, "/login", data=b"token=guess")[0] == 403
        # The next attempt waits, right token or not: it is not even checked.
        status, headers, body = http(node, "/login", data=f"token={ADMIN_TOKEN}".encode())
        assert status == 429 and int(headers["Retry-After"]) >= 1, status
        assert "Set-Cookie" not in headers and b"wait" in body
    finally:
        stop_node(node)

    clock = FakeClock()
    access = WebAccess(auth_on=True, admin_token=ADMIN_TOKEN, throttle=LoginThrottle(clock))
    waits = []
    for _ in range(FREE_FAILURES + 3):
        assert not access.login(login_environ("guess"))
        waits.append(access.login_wait(login_environ("")))
    assert waits == [0.0] * (FREE_FAILURES - 1) + [1.0, 2.0, 4.0, 8.0]  # doubling
    assert access.login_wait(login_environ("", address="10.0.0.8")) == 0.0  # per address
    clock.now += 8.0
    assert access.login_wait(login_environ("")) == 0.0
    assert access.login(login_environ(ADMIN_TOKEN))  # signing in forgets the failures
    assert access.login_wait(login_environ("")) == 0.0
    assert not access.login(login_environ("guess"))
    assert access.login_wait(login_environ("")) == 0.0  # the count started again
