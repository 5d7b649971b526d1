"""The prefix tree of a namespace, collapsed into shared runs.

Blocks form a forest through their ``parent`` hashes. A *run* is a maximal
chain of blocks in which every block but the last has exactly one child:
the stretch of tokens that the same set of requests share. A run ends where
requests diverge (several children) or at a leaf. For each run we report its
size (blocks, tokens), how many distinct cached continuations go through it
(``requests``: the leaf runs below it, 1 for a leaf) and its heat (the
lookups that hit its blocks). A system prompt shows up as a root run with
many requests.

Pure and synchronous: the CLI feeds it ListBlocks pages, the node's web page
feeds it the store's block snapshots. Built iteratively (chains can be tens
of thousands of blocks long), ordered deterministically: children by
requests, then hits (both descending), then first hash.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """What the tree needs to know about one resident block."""

    hash: bytes
    parent: bytes
    """Previous block's hash; empty (or absent from the set) at a root."""
    depth: int
    hits: int
    pins: int
    tenant: str
    writing: bool = False
    engines: tuple[str, ...] = ()
    """Serving engines of the node that hold this block too (ListBlocks ``engines``)."""


@dataclass(slots=True)
class Run:
    """A chain of blocks shared by the same requests."""

    first: bytes
    last: bytes
    depth: int
    """Depth of the first block (blocks before it in its chain)."""
    blocks: int
    tokens: int
    requests: int
    """Leaf runs at or below this run: the cached requests that share it."""
    hits: int
    """Lookups that hit the run's blocks, summed."""
    pins: int
    tenant: str
    writing: int
    children: list[Run] = field(default_factory=list)
    engines: dict[str, int] = field(default_factory=dict)
    """Per engine holding some of the run's blocks too: how many."""

    def to_json(self) -> dict[str, Any]:
        """Nested plain objects (children included), hashes in hex."""
        return {
            "first_hash": self.first.hex(),
            "last_hash": self.last.hex(),
            "depth": self.depth,
            "start_token": self.depth * (self.tokens // self.blocks if self.blocks else 0),
            "blocks": self.blocks,
            "tokens": self.tokens,
            "requests": self.requests,
            "hits": self.hits,
            "pins": self.pins,
            "writing": self.writing,
            "tenant": self.tenant,
            "engines": dict(sorted(self.engines.items())),
            "children": [child.to_json() for child in self.children],
        }


def _order(run: Run) -> tuple[int, int, bytes]:
    return (-run.requests, -run.hits, run.first)


def build_tree(records: Iterable[BlockRecord], block_size: int) -> list[Run]:
    """Collapse ``records`` into runs; returns the root runs, ordered.

    A block whose parent is not among ``records`` (depth 0, or its parent
    was evicted) starts a root run.
    """
    by_hash: dict[bytes, BlockRecord] = {}
    for rec in records:
        by_hash[rec.hash] = rec
    kids: dict[bytes, list[bytes]] = {}
    starts: list[bytes] = []
    for rec in by_hash.values():
        if rec.parent and rec.parent != rec.hash and rec.parent in by_hash:
            kids.setdefault(rec.parent, []).append(rec.hash)
        else:
            starts.append(rec.hash)
    roots: list[Run] = []
    made: list[Run] = []  # in creation order: parents before children
    seen: set[bytes] = set()
    stack: list[tuple[bytes, Run | None]] = [(h, None) for h in starts]
    while stack:
        start, parent_run = stack.pop()
        if start in seen:
            continue  # a cycle would be a corrupted table; never loop on it
        run = _walk(start, by_hash, kids, seen, block_size)
        made.append(run)
        (roots if parent_run is None else parent_run.children).append(run)
        stack.extend((child, run) for child in kids.get(run.last, ()))
    for run in reversed(made):  # children are finished before their parent
        run.requests = sum(c.requests for c in run.children) if run.children else 1
        run.children.sort(key=_order)
    roots.sort(key=_order)
    return roots


def _walk(
    start: bytes,
    by_hash: dict[bytes, BlockRecord],
    kids: dict[bytes, list[bytes]],
    seen: set[bytes],
    block_size: int,
) -> Run:
    """The run that starts at ``start``: follow single children."""
    rec = by_hash[start]
    run = Run(start, start, rec.depth, 0, 0, 0, 0, 0, rec.tenant, 0)
    current: bytes | None = start
    while current is not None and current not in seen:
        seen.add(current)
        rec = by_hash[current]
        run.last = current
        run.blocks += 1
        run.hits += rec.hits
        run.pins += rec.pins
        run.writing += int(rec.writing)
        for engine in rec.engines:
            run.engines[engine] = run.engines.get(engine, 0) + 1
        nxt = kids.get(current, ())
        current = nxt[0] if len(nxt) == 1 else None
    run.tokens = run.blocks * block_size
    return run


def count_runs(roots: Iterable[Run]) -> int:
    """Runs in the forest."""
    total = 0
    stack = list(roots)
    while stack:
        run = stack.pop()
        total += 1
        stack.extend(run.children)
    return total


def tree_json(
    namespace: str, block_size: int, roots: list[Run], blocks: int, total: int
) -> dict[str, Any]:
    """The JSON document of ``kvstore tree`` and the web page's ``/api/tree``."""
    return {
        "namespace": namespace,
        "block_size": block_size,
        "blocks": blocks,
        "total_blocks": total,
        "truncated": blocks < total,
        "runs": count_runs(roots),
        "shared_runs": sum(1 for r in _all(roots) if r.requests > 1),
        "roots": [root.to_json() for root in roots],
    }


def _all(roots: Iterable[Run]) -> Iterable[Run]:
    stack = list(roots)
    while stack:
        run = stack.pop()
        yield run
        stack.extend(run.children)
