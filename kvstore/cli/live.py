"""``watch`` (the live event stream) and ``nodes`` (the cluster view from Redis)."""

from __future__ import annotations

import datetime
import json as jsonlib
import sys
from typing import Annotated, Any

import grpc
import typer

from kvstore.api.wire import event_tier
from kvstore.cli.common import (
    DEFAULT_TARGET,
    EXIT_NOT_CONFIGURED,
    EXIT_UNREACHABLE,
    Json,
    Target,
    Token,
    column,
    connect,
    console,
    fail,
    print_json,
    size,
    table,
)
from kvstore.ops.plural import plural
from kvstore.v1 import kvstore_pb2 as pb

_KINDS = {
    pb.EVENT_KIND_STORED: "stored",
    pb.EVENT_KIND_REMOVED: "removed",
    pb.EVENT_KIND_CLEARED: "cleared",
    pb.EVENT_KIND_NODE_JOINED: "node_joined",
    pb.EVENT_KIND_NODE_LEFT: "node_left",
}


def event_json(ev: pb.Event) -> dict[str, Any]:
    """One event of ``kvstore watch --json`` (one JSON object per line)."""
    return {
        "kind": _KINDS.get(ev.kind, "unspecified"),
        "namespace": ev.namespace_id,
        "hashes": [h.hex() for h in ev.hashes],
        "parent": ev.parent.hex(),
        "at": ev.at,
        "node_id": ev.node_id,
        "tenant": ev.tenant,
        "tier": event_tier(ev),
    }


def event_line(doc: dict[str, Any]) -> str:
    """One event of ``kvstore watch`` (`event_json`'s fields): time, node, kind, tier
    (``-`` for a node event), namespace, blocks, first hash, tenant."""
    at = datetime.datetime.fromtimestamp(doc["at"]).strftime("%H:%M:%S.%f")[:-3]
    first = doc["hashes"][0][:12] if doc["hashes"] else ""
    return (
        f"{at} {doc['node_id']} {doc['kind']:<8} {doc['tier'] or '-':<6} {doc['namespace'][:12]} "
        f"{plural(len(doc['hashes']), 'block')} {first} {doc['tenant']}"
    )


def watch(
    target: Target = DEFAULT_TARGET,
    token: Token = "",
    json: Json = False,
    namespace: Annotated[
        str, typer.Option(help="Only this namespace: id, unique prefix, or model id.")
    ] = "",
    cluster: Annotated[bool, typer.Option(help="Every node's events (needs Redis).")] = False,
    count: Annotated[int, typer.Option(min=0, help="Stop after this many events (0: never).")] = 0,
    duration: Annotated[float, typer.Option(min=0, help="Stop after seconds (0: never).")] = 0,
) -> None:
    """Stream cache events (stored, removed, cleared, nodes joining and leaving), each with
    the tier of its blocks: memory (the pool) or disk (the disk tier)."""
    with connect(target, duration or 5.0, token) as node:
        ns_id = node.resolve_namespace(namespace).namespace_id if namespace else ""
        call = node.stub.WatchEvents(
            pb.WatchEventsRequest(namespace_id=ns_id, cluster=cluster),
            timeout=duration or None,  # a stream lives until stopped; --duration bounds it
            metadata=node.metadata,
        )
        try:
            call.initial_metadata()  # the subscription is in place once this returns
            if not call.is_active() and call.code() is not grpc.StatusCode.OK:
                # Ended already (a bad namespace, auth): the call is its own RpcError.
                assert isinstance(call, grpc.RpcError), "bug: a stream call that is no RpcError"
                raise call
            where = "the cluster" if cluster else target
            print(f"watching events on {where} (Ctrl-C to stop)", file=sys.stderr, flush=True)
            for seen, ev in enumerate(call, start=1):
                doc = event_json(ev)
                if json:
                    sys.stdout.write(jsonlib.dumps(doc) + "\n")
                    sys.stdout.flush()
                else:
                    console.print(event_line(doc))
                if count and seen >= count:
                    break
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and duration:
                return  # --duration elapsed: a normal end
            raise
        except KeyboardInterrupt:
            pass
        finally:
            call.cancel()


def nodes(
    json: Json = False,
    redis_url: Annotated[
        str,
        typer.Option(envvar="KVSTORE_REDIS_URL", help="Redis of the cluster (KVSTORE_REDIS_URL)."),
    ] = "",
    redis_prefix: Annotated[
        str, typer.Option(envvar="KVSTORE_REDIS_KEY_PREFIX", help="The cluster's key prefix.")
    ] = "kvstore",
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds per Redis call.")] = 5.0,
) -> None:
    """Live nodes of the cluster, from the Redis registry (read-only)."""
    if not redis_url:
        fail(
            "no Redis configured: `kvstore nodes` reads the cluster registry from Redis; "
            "pass --redis-url redis://HOST:6379 or set KVSTORE_REDIS_URL",
            EXIT_NOT_CONFIGURED,
        )
    rows = read_registry(redis_url, redis_prefix, timeout)
    if json:
        print_json(rows)
        return
    t = table(f"live nodes in {redis_url} (prefix {redis_prefix})")
    for col in ("node", "address", "devices", "used", "capacity", "version", "expires\nin"):
        column(t, col, number=col in ("used", "capacity", "expires\nin"))
    for r in rows:
        t.add_row(
            r["node_id"], r["address"], ",".join(r.get("devices", [])), _bytes(r, "used_bytes"),
            _bytes(r, "capacity_bytes"), str(r.get("version", "")),
            f"{r['expires_in_seconds']:.1f}s",
        )  # fmt: skip
    console.print(t)


def _bytes(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    return size(value) if isinstance(value, int | float) else "-"


def read_registry(url: str, prefix: str, timeout: float) -> list[dict[str, Any]]:
    """Live nodes from the registry keys (``{P}:alive`` deadlines, ``{P}:nodes`` infos).

    Read with plain commands, by Redis's own clock, like the service's
    registry does; the key layout is documented in ``service/cluster/keys.py``.
    """
    import redis  # only this command needs it

    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        seconds, micros = client.time()  # Redis's clock, never ours
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        alive: list[tuple[bytes, float]] = list(
            client.zrangebyscore(f"{{{prefix}}}:alive", now_ms, "+inf", withscores=True)  # type: ignore[arg-type]
        )
        infos: list[bytes | None] = (
            list(client.hmget(f"{{{prefix}}}:nodes", [n for n, _ in alive])) if alive else []  # type: ignore[arg-type]
        )
    except redis.RedisError as exc:
        fail(f"cannot read the registry from {url}: {exc}", EXIT_UNREACHABLE)
    finally:
        client.close()
    rows = []
    for (node_id, deadline), raw in zip(alive, infos, strict=True):
        doc: dict[str, Any] = jsonlib.loads(raw) if raw else {}
        doc.setdefault("node_id", node_id.decode())
        doc.setdefault("address", "")
        doc["expires_in_seconds"] = max(0.0, (deadline - now_ms) / 1000)
        rows.append(doc)
    return sorted(rows, key=lambda r: str(r["node_id"]))


COMMANDS = (watch, nodes)
"""The subcommands of this module, in help order; `kvstore.cli.app` registers them."""
