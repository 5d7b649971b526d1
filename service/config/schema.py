"""The server's configuration: one schema, read from flags, environment and a file.

Precedence, highest first: command-line flags (``--capacity-bytes 2GiB``),
environment variables (``KVSTORE_CAPACITY_BYTES=2GiB``), a config file
(``--config kvstore.toml`` or ``KVSTORE_CONFIG``; TOML or JSON, keys are the
field names), then the defaults below. `load_config` builds a `Config` from
all of them; a bad value raises `ConfigError` naming the field, the value and
where it came from. `service.config.docs` turns the schema into docs/config.md.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import logging
import os
import secrets
import socket
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import cache
from pathlib import Path
from typing import NoReturn

from kvstore.types import MAX_CHAIN_BLOCKS
from service.config.engines import EngineSource, parse_engine_sources
from service.config.values import (
    parse_bool,
    parse_device,
    parse_event_encoding,
    parse_file_mode,
    parse_huge_pages,
    parse_int,
    parse_log_level,
    parse_names,
    parse_non_negative,
    parse_non_negative_float,
    parse_peer_transport,
    parse_port,
    parse_positive,
    parse_positive_float,
    parse_secret,
    parse_size,
    parse_str,
    parse_verify_checksums,
)

log = logging.getLogger(__name__)

ENV_PREFIX = "KVSTORE_"


@dataclass(frozen=True, slots=True)
class Config:
    """Everything a cache node reads at start; see docs/config.md."""

    host: str = "127.0.0.1"
    """Address the gRPC server (and the metrics endpoint) binds to."""
    port: int = 50051
    """gRPC port; 0 picks a free one (tests)."""
    uds_path: str = ""
    """Unix-domain socket the gRPC server also listens on (runners on this host); empty = none."""
    metrics_port: int = 9400
    """Prometheus metrics port; 0 turns the endpoint off."""
    device: str = "cpu"
    """Where pools live: "cpu" (shared-memory files) or a GPU, "cuda:N" or "cuda:GPU-<uuid>"."""
    capacity_bytes: int = 1 << 30
    """Node memory budget shared by all namespace pools (sizes like 64MiB, 1GiB, 512M)."""
    namespace_capacity_bytes: int = 0
    """Most a namespace's pool grows to when RegisterNamespace asks for 0 bytes (0 = the budget)."""
    arena_bytes: int = 64 << 20
    """Unit a pool starts with, grows and gives back by (one mmap/IPC open per arena in runners)."""
    pool_headroom_bytes: int = 128 << 20
    """Free memory a pool keeps ready ahead of its stores, in whole arenas (0 = only on need)."""
    shm_dir: str = "/dev/shm"
    """Directory (tmpfs) that holds the pool files; created (mode 0700) when only it is missing."""
    pool_prefix: str = "kvstore"
    """File name prefix of the pool files; stale files with it are removed at start."""
    pool_file_mode: int = 0o600
    """Permission bits of the pool files (0o600, or 0o660 to share with a group); never world."""
    pool_file_group: str = ""
    """Group (name or gid) the pool files are given to, with mode 0o660; empty = the server's."""
    pool_prefault: bool = True
    """Touch every page of a new pool so the first writes do not fault."""
    pool_huge_pages: str = "auto"
    """Huge pages for host pools: auto (where the shm_dir tmpfs offers them), on (required), off."""
    lease_ttl_default: float = 30.0
    """TTL in seconds of a lease that asks for 0 (the SDK's default); at most lease_ttl_max."""
    lease_ttl_max: float = 3600.0
    """Longest TTL in seconds a lease may ask for; given alone, the default follows it down."""
    write_quarantine_seconds: float = 300.0
    """Seconds the slots an expired lease was writing stay unused (late writers; 0 = none)."""
    node_id: str = ""
    """Name of this node in stats and events; empty means hostname-port (the bound port)."""
    salt_secret: bytes = b""
    """Hex secret the tenant salts derive from; empty means random per process."""
    shared_namespaces: tuple[str, ...] = ()
    """Model ids whose blocks all tenants share (comma-separated in flags and env)."""
    grace_seconds: float = 5.0
    """Seconds in-flight RPCs get to finish on shutdown."""
    max_message_bytes: int = 64 << 20
    """Largest gRPC message the server sends or receives (a WriteBlocks message holds a block)."""
    max_request_bytes: int = 2 << 20
    """Largest request of a call other than WriteBlocks; over it is INVALID_ARGUMENT."""
    max_chain_blocks: int = MAX_CHAIN_BLOCKS
    """Most blocks one request may name; over it is INVALID_ARGUMENT (docs/api.md, Limits)."""
    max_request_tokens: int = 262144
    """Most tokens one Lookup or Reserve may send (also at most max_chain_blocks x block_size)."""
    max_namespaces: int = 64
    """Most namespaces this node holds."""
    max_pins_per_lease: int = 0
    """Pins one lease may hold at once (0 = unbounded); over it is RESOURCE_EXHAUSTED."""
    max_leases_per_tenant: int = 0
    """Live leases per tenant (0 = unbounded; max_leases in the tenants file overrides)."""
    max_concurrent_rpcs: int = 0
    """RPCs the server runs at once (0 = unbounded); beyond it gRPC answers RESOURCE_EXHAUSTED."""
    max_tenant_labels: int = 100
    """Tenants with own metric labels and counters; the rest count as _other (0 = no cap)."""
    tenants_file: str = ""
    """TOML/JSON file of tenant tokens, namespaces and quotas; set = auth on (docs/security.md)."""
    tls_cert: str = ""
    """PEM certificate chain of the gRPC server; set (with tls_key) = TLS only, no plaintext."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    tls_client_ca: str = ""
    """PEM CA bundle that client certificates must chain to; set = mutual TLS required."""
    peer_tls_ca: str = ""
    """PEM CA bundle peers' certificates chain to (peer fetch); empty = tls_client_ca or system."""
    log_level: str = "INFO"
    """Python logging level: DEBUG, INFO, WARNING, ERROR."""
    admin_token: str = ""
    """Bearer token of the admin verbs (Evict, Clear); empty allows them from loopback only."""
    web_session_seconds: float = 8 * 3600.0
    """Seconds the web page's sign-in cookie stays valid (then the admin token is asked again)."""
    stats_sample_seconds: float = 5.0
    """Seconds between the hit-rate samples the node's web page plots (last 360 kept)."""
    redis_url: str = ""
    """Redis holding the cluster metadata (redis://host:6379/0); empty = a node without Redis."""
    redis_cluster: bool = False
    """Treat redis_url as a Redis Cluster node (keys carry hash tags; see docs/cluster.md)."""
    redis_key_prefix: str = "kvstore"
    """Prefix (and hash tag) of every Redis key; nodes of one cluster share it."""
    redis_timeout: float = 1.0
    """Seconds one Redis command may take before the node counts Redis as down."""
    heartbeat_seconds: float = 1.0
    """Seconds between registry heartbeats (and directory lease refreshes)."""
    node_ttl_seconds: float = 5.0
    """A node silent this long vanishes from the registry and the directory."""
    directory_flush_seconds: float = 0.05
    """Longest delay before a committed or evicted block reaches the directory."""
    directory_queue_blocks: int = 100_000
    """Directory changes buffered while Redis is away; beyond this the node resyncs fully."""
    event_stream_maxlen: int = 100_000
    """Approximate length bound of the cluster event stream."""
    advertise_address: str = ""
    """host:port peers reach this node's gRPC at; empty = host and the bound port."""
    cluster_token: str = ""
    """Secret peers present to FetchBlocks (x-kvstore-peer-token); empty = any caller."""
    peer_fetch_concurrency: int = 4
    """Peer fetches running at once; more lookups with allow_remote are served locally."""
    peer_fetch_timeout: float = 5.0
    """Seconds a peer fetch (locate + stream) may take before it counts as a miss."""
    verify_checksums: str = "all"
    """Block checksums checked on runners' local loads too ("all", the default: a late
    writer's bytes are caught by every reader), or on peer fetches only ("peer")."""
    kv_events_endpoint: str = ""
    """ZMQ PUB endpoint of the node's block events in vLLM's format (tcp://*:5560); empty = off."""
    kv_events_replay_endpoint: str = ""
    """ZMQ ROUTER endpoint that resends published batches from a sequence number; empty = off."""
    kv_events_topic: str = ""
    """Topic frame of every published batch (subscribers filter on its prefix)."""
    kv_events_medium: str = ""
    """The medium the node's BlockStored/BlockRemoved name; empty = CPU_kvstore or GPU_kvstore."""
    kv_events_encoding: str = "map"
    """Event encoding: "map" (tagged maps, what vLLM 0.32 sends) or "array" (older vLLM's)."""
    kv_events_buffer_batches: int = 10_000
    """Published batches kept for replay, and batches queued for the sender thread."""
    engine_kv_events: tuple[EngineSource, ...] = ()
    """Engines whose vLLM KV events the node ingests: JSON list of {name, endpoint, model_id}."""
    engine_max_blocks: int = 1_000_000
    """Most blocks the node indexes per engine; later BlockStored blocks are counted and skipped."""
    peer_transport: str = "auto"
    """Peer fetch bytes: nixl (NIXL READ, pool to pool), grpc (stream), auto (nixl if installed)."""
    disk_path: str = ""
    """File on a local SSD the disk tier keeps blocks in (docs/disk.md); empty = memory only."""
    disk_capacity_bytes: int = 16 << 30
    """Size of the disk tier's file, preallocated; its blocks never take more (LRU beyond)."""
    disk_queue_blocks: int = 256
    """Block copies queued for disk writes; 16x this many wait uncopied, then blocks are skipped."""
    disk_io_threads: int = 4
    """Threads reading and writing the disk tier's file (reads in flight at once)."""
    disk_direct_io: bool = True
    """Open the disk file with O_DIRECT (no page cache); off only for file systems without it."""
    disk_promote_timeout: float = 0.5
    """Seconds a Lookup may spend reading blocks back from disk; then it answers what it has."""
    disk_flush_seconds: float = 2.0
    """Seconds a clean stop waits for queued disk writes before it closes the tier."""


class ConfigError(ValueError):
    """A configuration value is malformed or out of range."""


_PARSERS: dict[str, Callable[[object], object]] = {
    "host": parse_str,
    "port": parse_port,
    "uds_path": parse_str,
    "metrics_port": parse_port,
    "device": parse_device,
    "capacity_bytes": parse_positive(parse_size),
    "namespace_capacity_bytes": parse_non_negative(parse_size),
    "arena_bytes": parse_positive(parse_size),
    "pool_headroom_bytes": parse_non_negative(parse_size),
    "shm_dir": parse_str,
    "pool_prefix": parse_str,
    "pool_file_mode": parse_file_mode,
    "pool_file_group": parse_str,
    "pool_prefault": parse_bool,
    "pool_huge_pages": parse_huge_pages,
    "lease_ttl_default": parse_positive_float,
    "lease_ttl_max": parse_positive_float,
    "write_quarantine_seconds": parse_non_negative_float,
    "node_id": parse_str,
    "salt_secret": parse_secret,
    "shared_namespaces": parse_names,
    "grace_seconds": parse_non_negative_float,
    "max_message_bytes": parse_positive(parse_size),
    "max_request_bytes": parse_positive(parse_size),
    "max_chain_blocks": parse_positive(parse_int),
    "max_request_tokens": parse_positive(parse_int),
    "max_namespaces": parse_positive(parse_int),
    "max_pins_per_lease": parse_non_negative(parse_int),
    "max_leases_per_tenant": parse_non_negative(parse_int),
    "max_concurrent_rpcs": parse_non_negative(parse_int),
    "max_tenant_labels": parse_non_negative(parse_int),
    "tenants_file": parse_str,
    "tls_cert": parse_str,
    "tls_key": parse_str,
    "tls_client_ca": parse_str,
    "peer_tls_ca": parse_str,
    "log_level": parse_log_level,
    "admin_token": parse_str,
    "web_session_seconds": parse_positive_float,
    "stats_sample_seconds": parse_positive_float,
    "redis_url": parse_str,
    "redis_cluster": parse_bool,
    "redis_key_prefix": parse_str,
    "redis_timeout": parse_positive_float,
    "heartbeat_seconds": parse_positive_float,
    "node_ttl_seconds": parse_positive_float,
    "directory_flush_seconds": parse_positive_float,
    "directory_queue_blocks": parse_positive(parse_int),
    "event_stream_maxlen": parse_positive(parse_int),
    "advertise_address": parse_str,
    "cluster_token": parse_str,
    "peer_fetch_concurrency": parse_positive(parse_int),
    "peer_fetch_timeout": parse_positive_float,
    "verify_checksums": parse_verify_checksums,
    "kv_events_endpoint": parse_str,
    "kv_events_replay_endpoint": parse_str,
    "kv_events_topic": parse_str,
    "kv_events_medium": parse_str,
    "kv_events_encoding": parse_event_encoding,
    "kv_events_buffer_batches": parse_positive(parse_int),
    "engine_kv_events": parse_engine_sources,
    "engine_max_blocks": parse_positive(parse_int),
    "peer_transport": parse_peer_transport,
    "disk_path": parse_str,
    "disk_capacity_bytes": parse_positive(parse_size),
    "disk_queue_blocks": parse_positive(parse_int),
    "disk_io_threads": parse_positive(parse_int),
    "disk_direct_io": parse_bool,
    "disk_promote_timeout": parse_positive_float,
    "disk_flush_seconds": parse_non_negative_float,
}


def field_names() -> list[str]:
    """The fields of `Config`, in declaration order."""
    return [f.name for f in fields(Config)]


# --- loading ------------------------------------------------------------------


def _parse_field(name: str, value: object, source: str) -> object:
    try:
        return _PARSERS[name](value)
    except ValueError as exc:
        raise ConfigError(f"{name} ({source}): {exc}") from None


def _read_file(path: str) -> dict[str, object]:
    doc = read_document(path, "config file", ConfigError)
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {path} must hold a table of settings")
    unknown = sorted(set(doc) - set(_PARSERS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown settings {unknown}")
    return doc


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one `ConfigError` line, not the whole usage text.

    argparse prints the full usage (40-odd lines: a flag per setting) before
    its message; ``kvstore-server --prot 1`` should say what is wrong in one
    line and point at ``--help``, which still prints everything.
    """

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see kvstore-server --help)")


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser: one ``--field-name`` flag per `Config` field.

    A usage error (an unknown flag, a flag without its value) raises
    `ConfigError` with one line naming it, instead of printing the usage.
    """
    parser = _Parser(
        prog="kvstore-server", description="Run a kvstore cache node (see docs/config.md)."
    )
    parser.add_argument("--config", help="TOML or JSON file of settings (or KVSTORE_CONFIG)")
    docs = field_docs()
    for name in field_names():
        parser.add_argument(
            "--" + name.replace("_", "-"), dest=name, default=None, help=docs.get(name, "")
        )
    return parser


def load_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Build the `Config` from flags > environment > config file > defaults.

    Args:
        argv: command-line arguments without the program name (``sys.argv[1:]`` if None).
        env: environment variables (``os.environ`` if None).

    Raises:
        ConfigError: a value is malformed, or the file cannot be read.
    """
    env = os.environ if env is None else env
    args = vars(build_parser().parse_args(argv))
    values: dict[str, object] = {}
    config_path = args.pop("config") or env.get(ENV_PREFIX + "CONFIG")
    if config_path:
        for name, value in _read_file(config_path).items():
            values[name] = _parse_field(name, value, f"file {config_path}")
    for name in field_names():
        key = ENV_PREFIX + name.upper()
        if key in env:
            values[name] = _parse_field(name, env[key], f"environment {key}")
    for name, value in args.items():
        if value is not None:
            flag = "--" + name.replace("_", "-")
            values[name] = _parse_field(name, value, f"flag {flag}")
    if "lease_ttl_default" not in values and "lease_ttl_max" in values:
        # Only a maximum was given: the default follows it down (a default left
        # above the maximum would refuse every client that asks for 0).
        ttl_max = values["lease_ttl_max"]
        assert isinstance(ttl_max, float), "bug: lease_ttl_max parsed to a float"
        values["lease_ttl_default"] = min(Config().lease_ttl_default, ttl_max)
    config = Config(**values)  # type: ignore[arg-type]
    check(config)
    return config


def check(config: Config) -> None:
    """Cross-field checks; raises `ConfigError`."""
    if config.lease_ttl_default > config.lease_ttl_max:
        raise ConfigError(
            f"lease_ttl_default ({config.lease_ttl_default}) exceeds "
            f"lease_ttl_max ({config.lease_ttl_max})"
        )
    if config.redis_url and not config.salt_secret:
        raise ConfigError(
            "redis_url is set but salt_secret is not: every node of a cluster must share one "
            "salt_secret (KVSTORE_SALT_SECRET), or tenant hashes differ from node to node"
        )
    if config.heartbeat_seconds >= config.node_ttl_seconds:
        raise ConfigError(
            f"heartbeat_seconds ({config.heartbeat_seconds}) must be below "
            f"node_ttl_seconds ({config.node_ttl_seconds})"
        )
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ConfigError("tls_cert and tls_key go together: set both or neither")
    if config.tls_client_ca and not config.tls_cert:
        raise ConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
    if config.peer_tls_ca and not config.tls_cert:
        raise ConfigError("peer_tls_ca needs tls_cert and tls_key (peers speak TLS when we do)")
    if config.kv_events_replay_endpoint and not config.kv_events_endpoint:
        raise ConfigError("kv_events_replay_endpoint needs kv_events_endpoint (the PUB socket)")
    if config.namespace_capacity_bytes > config.capacity_bytes:
        log.info("namespace_capacity_bytes exceeds capacity_bytes; a pool grows to the budget")


def default_node_id(port: int) -> str:
    """The node id of a node that names none: ``HOSTNAME-PORT``.

    With ``port = 0`` the server renames the node after the port it bound
    (`service.server.Server.start`), so two nodes on one host never share
    ``HOSTNAME-0``.
    """
    return f"{socket.gethostname()}-{port}"


def resolve(config: Config) -> Config:
    """Fill the fields whose default depends on the host: node_id and salt_secret.

    A random salt secret means a restarted node (or another node) derives
    other tenant salts, so clients' precomputed hashes stop matching; logged
    as a warning so operators set one.
    """
    updates: dict[str, object] = {}
    if not config.node_id:
        updates["node_id"] = default_node_id(config.port)
    if not config.salt_secret:
        log.warning(
            "no salt_secret configured: using a random one for this process; tenant hashes "
            "change on restart and cannot be shared across nodes (set KVSTORE_SALT_SECRET)"
        )
        updates["salt_secret"] = secrets.token_bytes(32)
    return replace(config, **updates) if updates else config  # type: ignore[arg-type]


# --- docs ---------------------------------------------------------------------


@cache
def field_docs() -> dict[str, str]:
    """The one-line docstring of every `Config` field, read from the source."""
    tree = ast.parse(inspect.getsource(Config))
    body = tree.body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    last: str | None = None
    for node in body.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            last = node.target.id
        elif (
            last is not None
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[last] = node.value.value.strip()
            last = None
    return docs


def read_document(path: str, what: str, error: type[Exception]) -> object:
    """The document of a TOML file, or of a JSON one (a ``.json`` name).

    Args:
        path: the file.
        what: what the file is, for the messages ("config file", ...).
        error: the exception raised when it cannot be read or parsed.
    """
    file = Path(path)
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        doc: object = json.loads(raw) if file.suffix == ".json" else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{what} {path} is not valid TOML or JSON: {exc}") from None
    return doc


def read_setting_file(name: str, path: str) -> bytes:
    """The bytes of the file a setting names (a TLS certificate, key or CA).

    Raises:
        ConfigError: the file cannot be read; the message names the setting.
    """
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{name} {path}: {exc.strerror}") from None
