"""Usage mistakes get one line that names them and where the help is (#34)."""

from __future__ import annotations

import pytest

from kvstore.cli.common import target_problem
from tests.cli.conftest import kvstore


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--bogus",), "kvstore: no such option: --bogus (see kvstore --help)"),
        (("status", "--bogus"), "kvstore: no such option: --bogus (see kvstore status --help)"),
        (("blocks",), "kvstore: missing argument 'namespace' (see kvstore blocks --help)"),
        (("nosuch",), "kvstore: no such command 'nosuch' (see kvstore --help)"),
    ],
)
def test_a_usage_error_is_one_line_and_a_hint(args, said):
    r = kvstore(*args)
    assert r.code == 2
    assert r.stderr == said + "\n" and r.stdout == ""


def test_help_still_prints_the_usage():
    r = kvstore("status", "--help")
    assert r.code == 0 and "--json" in r.stdout and "--target" in r.stdout


def test_a_target_without_a_port_is_refused_with_an_example():
    r = kvstore("-t", "127.0.0.1", "status")
    assert r.code == 2
    assert r.stderr == (
        "kvstore: --target 127.0.0.1 has no port: give HOST:PORT, e.g. 127.0.0.1:50051\n"
    )


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        ("127.0.0.1:50051", None),
        ("[::1]:50051", None),
        ("node-1:7000", None),
        ("unix:/run/kvstore.sock", None),
        ("dns:///node-1:50051", None),
        ("node-1", "has no port: give HOST:PORT, e.g. node-1:50051"),
        ("[::1]", "has no port: give HOST:PORT, e.g. [::1]:50051"),
        ("::1", "write an IPv6 address in brackets, e.g. [::1]:50051"),
        ("node-1:x", "the port 'x' is not a number from 1 to 65535"),
        (":50051", "has no host"),
    ],
)
def test_target_problems(target, problem):
    found = target_problem(target)
    assert (found is None) if problem is None else (found is not None and problem in found)
