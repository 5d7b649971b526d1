"""Naming a namespace the way an operator would: by id, by model id, or by a prefix.

Namespace ids are 16 hex digits that nobody remembers; model ids
(``meta-llama/Llama-3.1-8B``) are what people type. Every tool that takes a
namespace (the ``kvstore`` CLI, the node's web page) resolves what it was
given with `resolve_namespace`, against the (id, model id) pairs that the
node's Stats reports, so the rules are the same everywhere:

1. an exact namespace id;
2. else an exact model id (two namespaces of one model, with different
   layouts, make it ambiguous);
3. else a prefix of exactly one namespace id or model id.

Anything else is an error that lists the candidates (ambiguous) or every
namespace there is (unknown). Pure: no I/O, no protobuf.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstore.errors import InvalidArgument, UnknownNamespace

MAX_LISTED = 10
"""Namespaces an error message names before it says ``and N more``."""


def describe(namespaces: Iterable[tuple[str, str]]) -> str:
    """``id (model), id (model)…`` for an error message, or ``none``."""
    pairs = sorted(namespaces)
    if not pairs:
        return "none"
    shown = ", ".join(
        f"{ns_id} ({model})" if model else ns_id for ns_id, model in pairs[:MAX_LISTED]
    )
    more = len(pairs) - MAX_LISTED
    return f"{shown} and {more} more" if more > 0 else shown


class UnknownNamespaceName(UnknownNamespace):
    """No namespace has this id or model id, and none starts with it."""

    def __init__(self, query: str, namespaces: Iterable[tuple[str, str]]) -> None:
        self.query = query
        self.known = sorted(namespaces)
        super().__init__(
            f"{query!r} is not a namespace of this node (by id, model id or prefix); "
            f"namespaces: {describe(self.known)}"
        )


class AmbiguousNamespace(InvalidArgument):
    """More than one namespace matches; the message lists them."""

    def __init__(self, query: str, candidates: Iterable[tuple[str, str]]) -> None:
        self.query = query
        self.candidates = sorted(candidates)
        super().__init__(
            f"{query!r} is ambiguous: it names {len(self.candidates)} namespaces: "
            f"{describe(self.candidates)}; give more of the id"
        )


def resolve_namespace(query: str, namespaces: Iterable[tuple[str, str]]) -> str:
    """The id of the namespace that ``query`` names among (id, model id) pairs.

    Raises `UnknownNamespaceName` (a `kvstore.errors.UnknownNamespace`) when
    nothing matches and `AmbiguousNamespace` (an `InvalidArgument`) when
    several do; an empty query names nothing.
    """
    pairs = list(dict.fromkeys((str(i), str(m)) for i, m in namespaces))
    query = query.strip()
    if not query:
        raise UnknownNamespaceName(query, pairs)
    for ns_id, _ in pairs:
        if ns_id == query:
            return ns_id
    for found in (
        [p for p in pairs if p[1] == query],
        [p for p in pairs if p[0].startswith(query) or p[1].startswith(query)],
    ):
        if len(found) == 1:
            return found[0][0]
        if found:
            raise AmbiguousNamespace(query, found)
    raise UnknownNamespaceName(query, pairs)


__all__ = ["AmbiguousNamespace", "UnknownNamespaceName", "describe", "resolve_namespace"]
