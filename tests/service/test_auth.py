"""The admin rule of `service.tenancy.auth`: token when configured, loopback otherwise."""

from __future__ import annotations

import pytest

from kvstore.errors import PermissionDenied
from service.api.errors import Unauthenticated, status_code_of
from service.tenancy.auth import bearer_token, check_admin, is_loopback_peer


@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.8.0.1:5000", True),
        ("ipv6:[::1]:5000", True),
        ("unix:/tmp/sock", True),
        ("ipv4:10.0.0.7:5000", False),
        ("ipv6:[fe80::1]:5000", False),
        ("ipv4:not-an-ip:1", False),
        ("", False),
    ],
)
def test_loopback_peers(peer, local):
    assert is_loopback_peer(peer) is local


def test_bearer_token():
    assert bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("authorization", b"bearer  abc ")]) == "abc"
    assert bearer_token([("x-kvstore-tenant", "t")]) is None


def test_token_configured():
    check_admin([("authorization", "Bearer s3cret")], "ipv4:10.0.0.7:1", "s3cret")
    with pytest.raises(Unauthenticated) as missing:
        check_admin([], "ipv4:127.0.0.1:1", "s3cret")  # loopback is not enough then
    assert status_code_of(missing.value).name == "UNAUTHENTICATED"
    with pytest.raises(PermissionDenied) as wrong:
        check_admin([("authorization", "Bearer nope")], "ipv4:127.0.0.1:1", "s3cret")
    assert status_code_of(wrong.value).name == "PERMISSION_DENIED"


def test_no_token_configured_means_loopback_only():
    check_admin([], "ipv4:127.0.0.1:1", "")
    with pytest.raises(PermissionDenied, match="admin_token"):
        check_admin([], "ipv4:10.0.0.7:1", "")
