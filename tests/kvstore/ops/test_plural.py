"""`plural`: the one rule for counted nouns in the CLI's and the node's lines (#34)."""

from __future__ import annotations

from kvstore.ops.plural import plural


def test_one_is_singular_everything_else_plural():
    assert [plural(n, "block") for n in (0, 1, 2)] == ["0 blocks", "1 block", "2 blocks"]
    assert plural(1, "more run") == "1 more run"


def test_an_irregular_plural_is_given():
    assert plural(1, "entry", "entries") == "1 entry"
    assert plural(3, "entry", "entries") == "3 entries"
