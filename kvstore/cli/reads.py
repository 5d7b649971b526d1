"""Read commands: ``status``, ``namespaces``, ``tenants``, ``blocks``, ``tree``."""

from __future__ import annotations

import datetime
from typing import Annotated, Any

import typer
from rich.tree import Tree

from kvstore.cli.common import (
    DEFAULT_TARGET,
    Json,
    Target,
    Timeout,
    Token,
    column,
    connect,
    console,
    pct,
    print_json,
    size,
    table,
)
from kvstore.ops.plural import plural
from kvstore.ops.prefix_tree import BlockRecord, Run, build_tree, tree_json
from kvstore.ops.summary import namespace_json, status_json, tenants_json
from kvstore.v1 import kvstore_pb2 as pb

Namespace = Annotated[str, typer.Argument(help="Namespace id, a unique id prefix, or model id.")]


def ago(unix: float) -> str:
    """A unix time as ``HH:MM:SS`` (local)."""
    return datetime.datetime.fromtimestamp(unix).strftime("%H:%M:%S") if unix else "-"


def duration(seconds: float) -> str:
    """``1h02m03s``."""
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def status(
    target: Target = DEFAULT_TARGET, token: Token = "", json: Json = False, timeout: Timeout = 5.0
) -> None:
    """Node capacity, use, pins, hit rates (tokens and blocks), leases, uptime."""
    with connect(target, timeout, token) as node:
        doc = status_json(node.stats(), target)
    if json:
        print_json(doc)
        return
    t = table(f"kvstore node {doc['node_id']} at {target}", show_header=False)
    column(t, "key", keep=10)
    column(t, "value")
    rows = [
        ("version", f"{doc['version']} ({doc['pool_kind']} pool, epoch {doc['pool_epoch']})"),
        ("uptime", duration(doc["uptime_seconds"])),
        ("memory", f"{size(doc['allocated_bytes'])} of {size(doc['capacity_bytes'])} allocated"),
        ("used", f"{doc['used_blocks']} of {plural(doc['capacity_blocks'], 'block')} "
                 f"({size(doc['used_bytes'])})"),
        ("pinned", f"{plural(doc['pinned_blocks'], 'block')} ({plural(doc['pins'], 'pin')})"),
        ("writing", plural(doc["writing_blocks"], "block")),
        ("hit rate", f"{pct(doc['hit_rate_tokens'])} of tokens "
                     f"({doc['hit_tokens']} hit / {doc['miss_tokens']} missed), "
                     f"{pct(doc['hit_rate_blocks'])} of blocks"),
        ("leases", f"{doc['leases']} live, {doc['leases_expired']} expired"),
        ("evictions", str(doc["evictions"])),
        ("namespaces", str(len(doc["namespaces"]))),
    ]  # fmt: skip
    if doc["disk"] is not None:
        rows.append(("disk", disk_line(doc["disk"])))
    for key, value in rows:
        t.add_row(key, value)
    console.print(t)


def disk_line(disk: dict[str, Any]) -> str:
    """The disk tier in one line of ``kvstore status``."""
    line = (
        f"{plural(disk['blocks'], 'block')}, "
        f"{size(disk['used_bytes'])} of {size(disk['capacity_bytes'])}; "
        f"{disk['promoted_blocks']} read back, {disk['written_blocks']} written, "
        f"{disk['dropped_writes']} skipped"
    )
    return line + (" (DEGRADED: no more writes)" if disk["degraded"] else "")


def namespaces(
    target: Target = DEFAULT_TARGET, token: Token = "", json: Json = False, timeout: Timeout = 5.0
) -> None:
    """Every namespace: model, block size, occupancy, evictions, hit rate."""
    with connect(target, timeout, token) as node:
        rows = [namespace_json(ns) for ns in node.stats().namespaces]
    if json:
        print_json(rows)
        return
    t = table(f"namespaces at {target}")
    column(t, "namespace", keep=16)
    column(t, "model")
    for col in ("block\nsize", "used/\ncapacity", "pinned", "evicted", "hit%"):
        column(t, col, number=True)
    for r in rows:
        t.add_row(
            r["namespace"], r["model"], str(r["block_size"]),
            f"{r['used_blocks']}/{r['capacity_blocks']}", str(r["pinned_blocks"]),
            str(r["evictions"]), pct(r["hit_rate_tokens"]),
        )  # fmt: skip
    console.print(t)


def tenants(
    target: Target = DEFAULT_TARGET,
    token: Token = "",
    json: Json = False,
    timeout: Timeout = 5.0,
    namespace: Annotated[
        str, typer.Option(help="Only this namespace: id, unique prefix, or model id.")
    ] = "",
) -> None:
    """Per-tenant lookups, hits and misses (tokens, blocks, miss reasons), residency."""
    with connect(target, timeout, token) as node:
        stats = node.stats()
        ns_id = node.resolve_namespace(namespace, stats).namespace_id if namespace else ""
        rows = tenants_json(stats, ns_id)
    if json:
        print_json(rows)
        return
    models = {ns.namespace_id: ns.model_id for ns in stats.namespaces}
    by_namespace: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_namespace.setdefault(r["namespace"], []).append(r)
    if not by_namespace:
        console.print(f"no tenant has used a namespace at {target} yet")
    for ns_id, ns_rows in by_namespace.items():  # one table a namespace: fits 80 columns
        t = table(f"tenants of {models.get(ns_id, '')} {ns_id} at {target}")
        column(t, "tenant")
        for col in ("lookups", "hit\ntokens", "miss\ntokens", "hit%", "miss\nabsent",
                    "miss in\nflight", "resident\nblocks"):  # fmt: skip
            column(t, col, number=True)
        for r in ns_rows:
            t.add_row(
                r["tenant"] or "(shared)", str(r["lookups"]), str(r["hit_tokens"]),
                str(r["miss_tokens"]), pct(r["hit_rate_tokens"]), str(r["miss_absent"]),
                str(r["miss_in_flight"]), str(r["resident_blocks"]),
            )  # fmt: skip
        console.print(t)


_STATES = {pb.BLOCK_STATE_READY: "ready", pb.BLOCK_STATE_WRITING: "writing"}


def block_json(b: pb.BlockInfo) -> dict[str, Any]:
    """One block of ``kvstore blocks --json``."""
    return {
        "hash": b.hash.hex(),
        "parent": b.parent.hex(),
        "tenant": b.tenant,
        "depth": b.depth,
        "state": _STATES.get(b.state, "free"),
        "pins": b.pins,
        "hits": b.hits,
        "slot": b.slot,
        "generation": b.generation,
        "created": b.created,
        "last_used": b.last_used,
        "engines": list(b.engines),
    }


def blocks(
    namespace: Namespace,
    target: Target = DEFAULT_TARGET,
    token: Token = "",
    json: Json = False,
    timeout: Timeout = 5.0,
    page_size: Annotated[int, typer.Option(min=1, max=1000, help="Blocks per page.")] = 50,
    page: Annotated[str, typer.Option(help="Page token from the previous page.")] = "",
) -> None:
    """One page of a namespace's blocks: hits, last use, depth, pins, state."""
    with connect(target, timeout, token) as node:
        ns = node.resolve_namespace(namespace)
        resp = node.list_blocks(ns.namespace_id, page_size, page)
    rows = [block_json(b) for b in resp.blocks]
    doc: dict[str, Any] = {
        "namespace": ns.namespace_id,
        "total": resp.total,
        "next_page_token": resp.next_page_token,
        "blocks": rows,
    }
    if json:
        print_json(doc)
        return
    t = table(f"{ns.model_id} {ns.namespace_id}: {plural(resp.total, 'block')}")
    for col in ("hash", "parent"):
        column(t, col, keep=12)
    for col in ("depth", "state", "pins", "hits", "last\nused", "tenant"):
        column(t, col, number=col in ("depth", "pins", "hits", "last\nused"))
    for b in rows:
        t.add_row(
            b["hash"][:12], b["parent"][:12] or "-", str(b["depth"]), b["state"], str(b["pins"]),
            str(b["hits"]), ago(b["last_used"]), b["tenant"] or "(shared)",
        )  # fmt: skip
    console.print(t)
    if resp.next_page_token:
        console.print(f"next page: kvstore blocks {namespace} --page {resp.next_page_token}")


def records(blocks: list[pb.BlockInfo]) -> list[BlockRecord]:
    """Tree input from ListBlocks entries."""
    return [
        BlockRecord(
            hash=b.hash,
            parent=b.parent,
            depth=b.depth,
            hits=b.hits,
            pins=b.pins,
            tenant=b.tenant,
            writing=b.state == pb.BLOCK_STATE_WRITING,
            engines=tuple(b.engines),
        )
        for b in blocks
    ]


def _label(run: Run) -> str:
    shared = f"shared by {run.requests}" if run.requests > 1 else "1 request"
    who = f" · tenant {run.tenant}" if run.tenant else ""
    pins = f" · {plural(run.pins, 'pin')}" if run.pins else ""
    engines = "".join(f" · engine {e} {n}/{run.blocks}" for e, n in sorted(run.engines.items()))
    start = run.depth * (run.tokens // run.blocks)
    blocks = f"{plural(run.blocks, 'block')} from token {start}"
    return (
        f"[bold]{plural(run.tokens, 'token')}[/] ({blocks}) · {shared} · "
        f"{plural(run.hits, 'hit')}{pins}{who}{engines} · [dim]{run.first.hex()[:12]}[/]"
    )


def tree(
    namespace: Namespace,
    target: Target = DEFAULT_TARGET,
    token: Token = "",
    json: Json = False,
    timeout: Timeout = 10.0,
    max_blocks: Annotated[int, typer.Option(min=1, help="Most blocks to read.")] = 100_000,
    max_runs: Annotated[int, typer.Option(min=1, help="Most runs to draw (not JSON).")] = 200,
) -> None:
    """The prefix tree collapsed into shared runs: sizes, sharing requests, heat."""
    with connect(target, timeout, token) as node:
        ns = node.resolve_namespace(namespace)
        got, total = node.all_blocks(ns.namespace_id, max_blocks)
    roots = build_tree(records(got), ns.block_size)
    doc = tree_json(ns.namespace_id, ns.block_size, roots, len(got), total)
    if json:
        print_json(doc)
        return
    title = (
        f"{ns.model_id} {ns.namespace_id}: {plural(doc['blocks'], 'block')} in "
        f"{plural(doc['runs'], 'run')}, "
        f"{doc['shared_runs']} shared"
    )
    if doc["truncated"]:
        title += f" (first {len(got)} of {total})"
    top = Tree(title)
    budget = max_runs
    stack: list[tuple[Run, Tree]] = [(r, top) for r in reversed(roots)]
    while stack and budget > 0:
        run, parent = stack.pop()
        budget -= 1
        branch = parent.add(_label(run))
        stack.extend((c, branch) for c in reversed(run.children))
    console.print(top)
    if stack:
        console.print(f"... {plural(doc['runs'] - max_runs, 'more run')} (--max-runs, or --json)")


__all__ = ["blocks", "namespace_json", "namespaces", "status", "tenants", "tree"]


COMMANDS = (status, namespaces, tenants, blocks, tree)
"""The subcommands of this module, in help order; `kvstore.cli.app` registers them."""
