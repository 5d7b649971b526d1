"""Prometheus metrics of one cache node, in its own registry.

Counters and histograms are updated by the servicer as calls happen; the
occupancy gauges (blocks per state, leases, evictions) are computed from a
store snapshot at scrape time by `_StoreCollector`. Each `Metrics` has its
own `CollectorRegistry`, so tests can run several servers in one process.

Bounded by design: the ``tenant`` label takes at most ``max_tenant_labels``
distinct values (`TenantLabels`); later tenants are counted under
``_other``, so a client inventing tenant names (auth off) cannot grow the
series without bound. A call the client cancelled (a ``kvstore watch``
stopped with Ctrl-C, a runner that gave up) is counted in
``kvstore_rpc_cancelled_total``, not as an error.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIServer, make_server

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import make_wsgi_app as _make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler
from prometheus_client.registry import Collector

from kvstore.store import StoreStats
from kvstore.tenant_counters import OTHER_TENANTS

log = logging.getLogger(__name__)

Snapshot = Callable[[], StoreStats | None]
"""Returns a consistent store snapshot (None when it cannot be taken now)."""

WsgiApp = Callable[..., Iterable[bytes]]
"""A WSGI application (``app(environ, start_response)``)."""

RPC_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
"""RPC latency buckets, seconds: a lookup takes ~0.1-0.5 ms, so they start at 50 us."""

DEFAULT_TENANT_LABELS = 100
"""Distinct ``tenant`` label values before the rest fold into ``_other``."""

NodeInfo = Callable[[], dict[str, float]]
"""Node-wide gauges read at scrape time: capacity_bytes, allocated_bytes, huge_page_bytes,
uptime_seconds."""


class _StoreCollector(Collector):
    """Occupancy gauges computed from a store snapshot at scrape time."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats = self._snapshot()
        if stats is None:
            return
        blocks = GaugeMetricFamily(
            "kvstore_blocks", "Slots of each namespace by state", labels=["namespace", "state"]
        )
        capacity = GaugeMetricFamily(
            "kvstore_capacity_blocks", "Slots of each namespace's pool", labels=["namespace"]
        )
        evictions = CounterMetricFamily(
            "kvstore_evictions", "Blocks evicted to make room", labels=["namespace"]
        )
        info = GaugeMetricFamily(
            "kvstore_namespace_info",
            "1 per namespace, naming its model (join on namespace to chart by model)",
            labels=["namespace", "model", "block_size", "block_bytes"],
        )
        for ns in stats.namespaces:
            for state, value in (
                ("free", ns.free),
                ("quarantined", ns.quarantined),
                ("ready", ns.ready),
                ("writing", ns.writing),
                ("pinned", ns.pinned),
            ):
                blocks.add_metric([ns.namespace, state], value)
            capacity.add_metric([ns.namespace], ns.capacity)
            evictions.add_metric([ns.namespace], ns.evictions)
            info.add_metric([ns.namespace, ns.model_id, str(ns.block_size), str(ns.block_bytes)], 1)
        yield info
        yield blocks
        yield capacity
        yield evictions
        yield GaugeMetricFamily("kvstore_leases", "Live leases", value=stats.leases)
        yield GaugeMetricFamily(
            "kvstore_lease_pins", "Pins held by leases, counting repeats",
            value=stats.pinned_by_leases,
        )  # fmt: skip


class _NodeCollector(Collector):
    """Node-wide gauges (memory budget, uptime) read at scrape time."""

    def __init__(self, node_info: NodeInfo) -> None:
        self._node_info = node_info

    def collect(self) -> Iterator[Metric]:
        info = self._node_info()
        for name, doc in (
            ("capacity_bytes", "The node's memory budget"),
            ("allocated_bytes", "Memory carved into namespace pools"),
            ("huge_page_bytes", "Pool memory backed by huge pages (pool_huge_pages)"),
            ("uptime_seconds", "Seconds since the node started"),
        ):
            yield GaugeMetricFamily(f"kvstore_node_{name}", doc, value=info[name])


ClusterInfo = Callable[[], dict[str, float] | None]
"""Redis and peer-fetch figures read at scrape time; None on a node without Redis."""

_CLUSTER_METRICS = (
    ("redis_connected", "1 while the node reaches Redis, else 0", GaugeMetricFamily),
    ("directory_resyncs", "Full rewrites of this node's directory entry", CounterMetricFamily),
    ("events_dropped", "Cluster events dropped while Redis was away", CounterMetricFamily),
    ("peer_fetched_blocks", "Blocks pulled from peer nodes", CounterMetricFamily),
    ("peer_failed_fetches", "Peer fetches that failed (answered as misses)", CounterMetricFamily),
)


class _ClusterCollector(Collector):
    """Cross-node figures (Redis link, directory, peer fetch) read at scrape time."""

    def __init__(self, cluster_info: ClusterInfo) -> None:
        self._cluster_info = cluster_info

    def collect(self) -> Iterator[Metric]:
        info = self._cluster_info()
        if info is None:
            return
        for name, doc, family in _CLUSTER_METRICS:
            yield family(f"kvstore_{name}", doc, value=info[name])
        fetches = CounterMetricFamily(
            "kvstore_peer_fetches",
            "Peer fetches that brought blocks, per transport (nixl, grpc)",
            labels=["transport"],
        )
        for transport in ("nixl", "grpc"):
            fetches.add_metric([transport], info.get(f"peer_fetches_{transport}", 0.0))
        yield fetches


class TenantLabels:
    """The bounded set of values the ``tenant`` label takes.

    The first ``limit`` distinct tenants keep their own label; every later
    one is `OTHER_TENANTS` (``_other``, not a valid tenant name, so it
    cannot collide). First come, first kept: a label series, once exported,
    stays (Prometheus counters must not move between series). 0 = no bound
    (only sensible with auth on, where the tenants file bounds the names).
    Used on the event loop only.
    """

    def __init__(self, limit: int = DEFAULT_TENANT_LABELS) -> None:
        self.limit = limit
        self._kept: set[str] = set()

    def __len__(self) -> int:
        return len(self._kept)

    def label(self, tenant: str) -> str:
        """The label value ``tenant`` is counted under."""
        if tenant in self._kept:
            return tenant
        if self.limit and len(self._kept) >= self.limit:
            return OTHER_TENANTS
        self._kept.add(tenant)
        return tenant


class Metrics:
    """The node's metrics; `start_http` serves them on the metrics port."""

    def __init__(
        self, snapshot: Snapshot | None = None, *, max_tenant_labels: int = DEFAULT_TENANT_LABELS
    ) -> None:
        self.tenant_labels = TenantLabels(max_tenant_labels)
        """The tenant label values in use (bounded; the rest are ``_other``)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        tenant_labels = ["namespace", "tenant", "result"]
        self.lookup_tokens = Counter(
            "kvstore_lookup_tokens", "Tokens looked up, by hit or miss", tenant_labels, registry=r
        )
        self.lookup_blocks = Counter(
            "kvstore_lookup_blocks",
            "Full blocks looked up, by hit or miss",
            tenant_labels,
            registry=r,
        )
        self.lease_expiries = Counter(
            "kvstore_lease_expiries", "Leases ended because their TTL passed", registry=r
        )
        self.rpc_duration = Histogram(
            "kvstore_rpc_duration_seconds",
            "Time to answer an RPC",
            ["method"],
            registry=r,
            buckets=RPC_BUCKETS,
        )
        self.rpc_errors = Counter(
            "kvstore_rpc_errors",
            "RPCs that ended with an error (client cancellations excluded)",
            ["method", "code"],
            registry=r,
        )
        self.rpc_cancelled = Counter(
            "kvstore_rpc_cancelled",
            "RPCs the client cancelled or gave up on (a stopped watch); not errors",
            ["method"],
            registry=r,
        )
        self.watch_dropped = Counter(
            "kvstore_watch_dropped_events", "Events dropped for slow watchers", registry=r
        )
        self.checksum_failures = Counter(
            "kvstore_checksum_failures",
            "Blocks whose bytes did not match their writer's checksum (served as misses), "
            "by where they were checked (peer: a peer fetch; disk: read back from the disk tier; "
            "local: a node-side local read)",
            ["namespace", "tier"],
            registry=r,
        )
        if snapshot is not None:
            r.register(_StoreCollector(snapshot))
        self._http: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def add_node_info(self, node_info: NodeInfo) -> None:
        """Export ``kvstore_node_capacity_bytes``, ``_allocated_bytes``, ``_uptime_seconds``."""
        self.registry.register(_NodeCollector(node_info))

    def add_cluster_info(self, cluster_info: ClusterInfo) -> None:
        """Export the Redis link, directory resync and peer-fetch figures."""
        self.registry.register(_ClusterCollector(cluster_info))

    def observe_rpc(self, method: str, seconds: float, code: grpc.StatusCode) -> None:
        """Record one finished RPC (CANCELLED: the client left; not an error).

        The node never answers CANCELLED itself (`service.api.errors` maps no
        error to it), so that code always means the client cancelled the
        call, its deadline passed, or the node is shutting down.
        """
        self.rpc_duration.labels(method).observe(seconds)
        if code is grpc.StatusCode.CANCELLED:
            self.rpc_cancelled.labels(method).inc()
        elif code is not grpc.StatusCode.OK:
            self.rpc_errors.labels(method, code.name).inc()

    def observe_lookup(
        self, namespace: str, tenant: str, hit_blocks: int, miss_blocks: int, hit_tokens: int,
        miss_tokens: int,
    ) -> None:  # fmt: skip
        """Record one lookup's hits and misses in blocks and tokens."""
        tenant = self.tenant_labels.label(tenant)
        self.lookup_blocks.labels(namespace, tenant, "hit").inc(hit_blocks)
        self.lookup_blocks.labels(namespace, tenant, "miss").inc(miss_blocks)
        self.lookup_tokens.labels(namespace, tenant, "hit").inc(hit_tokens)
        self.lookup_tokens.labels(namespace, tenant, "miss").inc(miss_tokens)

    def render(self) -> bytes:
        """The text exposition of every metric (what a scrape returns)."""
        return generate_latest(self.registry)

    def wsgi_app(self) -> WsgiApp:
        """The WSGI app that answers scrapes (any path; `service.ops.web` routes /metrics)."""
        app: WsgiApp = _make_wsgi_app(self.registry)
        return app

    def start_http(self, host: str, port: int, app: WsgiApp | None = None) -> int:
        """Serve ``app`` (default: `wsgi_app`) on ``host:port`` in a daemon thread.

        Returns:
            The bound port.
        """

        class _Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        server = make_server(
            host, port, app or self.wsgi_app(), _Server, handler_class=_SilentHandler
        )
        thread = threading.Thread(target=server.serve_forever, name="kvstore-http", daemon=True)
        thread.start()
        self._http, self._thread = server, thread
        bound: int = server.server_port
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def stop_http(self) -> None:
        """Stop the metrics endpoint; idempotent."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
