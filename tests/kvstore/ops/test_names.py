"""`resolve_namespace`: id > model id > unique prefix; ambiguous and unknown list what exists."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument, UnknownNamespace
from kvstore.ops.names import (
    MAX_LISTED,
    AmbiguousNamespace,
    UnknownNamespaceName,
    resolve_namespace,
)

NAMESPACES = [
    ("0a1b2c3d4e5f6071", "meta-llama/Llama-3.1-8B"),
    ("0a1b99999e5f6071", "meta-llama/Llama-3.1-70B"),
    ("f00dfeedf00dfeed", "qwen/Qwen3-8B"),
    ("beefbeefbeefbeef", "demo-model"),
]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("f00dfeedf00dfeed", "f00dfeedf00dfeed"),  # exact id
        ("demo-model", "beefbeefbeefbeef"),  # exact model id
        ("meta-llama/Llama-3.1-8B", "0a1b2c3d4e5f6071"),  # exact model, though a prefix of 2
        ("f00d", "f00dfeedf00dfeed"),  # unique id prefix
        ("0a1b2", "0a1b2c3d4e5f6071"),
        ("qwen", "f00dfeedf00dfeed"),  # unique model prefix
        ("meta-llama/Llama-3.1-7", "0a1b99999e5f6071"),
        ("  demo-model ", "beefbeefbeefbeef"),  # pasted with blanks
    ],
)
def test_resolves(query, expected):
    assert resolve_namespace(query, NAMESPACES) == expected


def test_an_exact_id_beats_a_model_named_like_it():
    pairs = [("aaaaaaaaaaaaaaaa", "m"), ("bbbbbbbbbbbbbbbb", "aaaaaaaaaaaaaaaa")]
    assert resolve_namespace("aaaaaaaaaaaaaaaa", pairs) == "aaaaaaaaaaaaaaaa"


def test_an_exact_model_beats_a_prefix_of_an_id():
    pairs = [("beef000000000000", "x"), ("1111111111111111", "beef")]
    assert resolve_namespace("beef", pairs) == "1111111111111111"


@pytest.mark.parametrize("query", ["0a1b", "meta-llama", "0"])
def test_ambiguous_lists_the_candidates(query):
    with pytest.raises(AmbiguousNamespace) as info:
        resolve_namespace(query, NAMESPACES)
    err = info.value
    assert isinstance(err, InvalidArgument) and err.query == query
    assert [i for i, _ in err.candidates] == ["0a1b2c3d4e5f6071", "0a1b99999e5f6071"]
    assert "ambiguous" in str(err)
    assert "0a1b2c3d4e5f6071 (meta-llama/Llama-3.1-8B)" in str(err)
    assert "f00dfeedf00dfeed" not in str(err)


def test_one_model_with_two_layouts_is_ambiguous():
    pairs = [("1111111111111111", "m"), ("2222222222222222", "m")]
    with pytest.raises(AmbiguousNamespace) as info:
        resolve_namespace("m", pairs)
    assert len(info.value.candidates) == 2


@pytest.mark.parametrize("query", ["nope", "", "   ", "demo-model-2", "F00D"])
def test_unknown_lists_what_exists(query):
    with pytest.raises(UnknownNamespaceName) as info:
        resolve_namespace(query, NAMESPACES)
    err = info.value
    assert isinstance(err, UnknownNamespace)
    assert "not a namespace" in str(err)
    for ns_id, model in NAMESPACES:
        assert f"{ns_id} ({model})" in str(err)


def test_unknown_on_an_empty_node_says_none():
    with pytest.raises(UnknownNamespaceName, match="namespaces: none"):
        resolve_namespace("demo-model", [])


def test_long_lists_are_cut():
    pairs = [(f"{i:016x}", f"model-{i}") for i in range(MAX_LISTED + 5)]
    with pytest.raises(UnknownNamespaceName) as info:
        resolve_namespace("nope", pairs)
    assert str(info.value).endswith("and 5 more") and len(info.value.known) == MAX_LISTED + 5


def test_duplicate_pairs_are_one_namespace():
    pairs = [("1111111111111111", "m"), ("1111111111111111", "m")]
    assert resolve_namespace("m", pairs) == "1111111111111111"
    assert resolve_namespace("11", pairs) == "1111111111111111"
