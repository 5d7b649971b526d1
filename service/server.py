"""Server bootstrap: gRPC, health, reflection, metrics, lease expiry, shutdown.

`Server` is what tests start (``port=0`` binds a free port); `serve` runs
one until SIGTERM or SIGINT; `main` is the ``kvstore-server`` command.
Shutdown order: health NOT_SERVING (load balancers stop sending), event
streams end, ``server.stop(grace)`` lets in-flight calls finish, the disk
tier (with ``disk_path``) gets its queued writes flushed for up to
``disk_flush_seconds`` and is closed, then the pools are closed and their
files unlinked.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import stat
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from types import TracebackType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.v1 import kvstore_pb2
from service.api import decode
from service.api.servicer import KVStoreServicer
from service.config import (
    Config,
    ConfigError,
    default_node_id,
    load_config,
    read_setting_file,
    resolve,
)
from service.node import Clock, Node
from service.ops.web import HitRateHistory, WebApp, on_loop, sample_forever
from service.paths import check_paths

log = logging.getLogger(__name__)

SERVICE_NAME: str = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name
"""Fully qualified name of the KVStore service (health and reflection use it)."""

EXPIRY_TICK = 1.0
"""Longest sleep of the lease-expiry task, in seconds."""


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    """TLS credentials from ``tls_cert``/``tls_key`` (mTLS with ``tls_client_ca``), or None.

    Raises:
        ConfigError: a file cannot be read.
    """
    if not config.tls_cert:
        return None

    ca = read_setting_file("tls_client_ca", config.tls_client_ca) if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [
            (
                read_setting_file("tls_key", config.tls_key),
                read_setting_file("tls_cert", config.tls_cert),
            )
        ],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_problem(host: str, port: int) -> str | None:
    """Why gRPC could not bind ``host:port``, found with a plain socket first; None if it can.

    gRPC's own failure is a C-core log line on stderr (``add_port.cc ... Address
    already in use``) and a port of 0; probing first lets the node say it in one
    line of its own. Like gRPC, the port counts as free when any address
    ``host`` resolves to binds (``SO_REUSEADDR``, as gRPC sets it).
    """
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"the host {host!r} does not resolve ({exc.strerror}); choose another --host"
    problems: list[str] = []
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    problems.append(
                        f"port {port} is in use (another kvstore-server?); choose another --port"
                    )
                elif exc.errno == errno.EADDRNOTAVAIL:
                    problems.append(f"{host} is not an address of this host; choose another --host")
                else:
                    problems.append(f"{exc.strerror or exc}")
            else:
                return None
    return problems[0] if problems else None


class Server:
    """One cache node's gRPC server; ``async with Server(cfg) as s:`` or start/stop."""

    def __init__(
        self, config: Config, *, clock: Clock = time.monotonic, expiry_tick: float = EXPIRY_TICK
    ) -> None:
        """Prepare a server; nothing binds until `start`.

        Args:
            config: the node's configuration (node_id and salt_secret are
                resolved here when empty).
            clock: monotonic clock of the store (tests inject one to move time).
            expiry_tick: longest sleep of the lease-expiry task.

        Raises:
            PathError: a path setting cannot be used (`service.paths`).
        """
        self._named_after_port = not config.node_id and config.port == 0
        """A node with no node_id on port 0 is named after the port it binds (`start`)."""
        self.config = resolve(config)
        check_paths(self.config)  # before anything reads a file or binds a port
        self.node = Node(self.config, clock=clock)
        self.expiry_tick = expiry_tick
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.uds_path = ""
        """The Unix-domain socket bound (``uds_path``), removed again at `stop`."""
        self.metrics_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._serving = False
        """The gRPC server started: only then does `stop` log that the node stopped."""
        self._expiry: asyncio.Task[None] | None = None
        self.history = HitRateHistory()
        """Hit-rate samples that the web page on the metrics port plots."""
        self._sampler: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        """``host:port`` the server listens on (after `start`)."""
        return _address(self.config.host, self.port)

    async def start(self) -> int:
        """Bind, start serving and report SERVING; returns the bound gRPC port.

        Both ports are bound before anything else happens (stale pool files
        are removed only after), so a second node started with the same
        ports fails with an `OSError` naming the port and leaves the first
        one's files alone.
        """
        if self._grpc is not None:
            raise RuntimeError("bug: Server.start called twice")
        node = self.node
        node.loop = asyncio.get_running_loop()
        server = self._grpc_server()
        self._grpc = server
        try:
            self._bind(server)
            if self._named_after_port:  # HOSTNAME-0 would name every such node alike
                self.config = replace(self.config, node_id=default_node_id(self.port))
                node.config, node.node_id = self.config, self.config.node_id
            node.metrics.add_node_info(self._node_info)
            node.metrics.add_cluster_info(self._cluster_info)
            if self.config.metrics_port:
                self.metrics_port = self._bind_metrics()
            node.pools.cleanup()
            await server.start()
            self._serving = True
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            self._sampler = asyncio.create_task(
                sample_forever(node, self.history, self.config.stats_sample_seconds),
                name="kvstore-stats-sampler",
            )
            self._expiry = asyncio.create_task(self._expire_leases(), name="kvstore-lease-expiry")
            node.kv_events.start()  # no-op without kv_events_endpoint / engine_kv_events
            await node.join_cluster(self.address)  # no-op without redis_url
        except BaseException:
            # Unbind and stop what started, or the port stays taken and the
            # grpc server's finalizer raises after the loop has closed.
            await self.stop(0)
            raise
        log.info("node %s serving on %s (pool epoch %d)", node.node_id, self.address, node.epoch)
        return self.port

    def _grpc_server(self) -> grpc.aio.Server:
        """The gRPC server with every service registered; not bound yet."""
        limit = self.config.max_message_bytes
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
                # gRPC sets SO_REUSEPORT by default: a second node on the same
                # port would bind too and silently take half the connections.
                ("grpc.so_reuseport", 0),
            ],
            # Beyond this gRPC itself answers RESOURCE_EXHAUSTED.
            maximum_concurrent_rpcs=self.config.max_concurrent_rpcs or None,
        )
        # Raw request bytes: the guards decode them, so bad bytes are INVALID_ARGUMENT.
        decode.add_servicer(KVStoreServicer(self.node), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        return server

    def _bind(self, server: grpc.aio.Server) -> None:
        """Bind the gRPC port (TLS when configured); `OSError` naming it if taken."""
        address = _address(self.config.host, self.config.port)
        problem = bind_problem(self.config.host, self.config.port)
        if problem is not None:
            raise OSError(f"cannot bind the gRPC server to {address}: {problem}")
        try:
            credentials = server_credentials(self.config)
            if credentials is None:
                self.port = server.add_insecure_port(address)
            else:
                self.port = server.add_secure_port(address, credentials)
        except RuntimeError:
            self.port = 0
        if not self.port:
            raise OSError(
                f"cannot bind the gRPC server to {address}: port {self.config.port} is in use"
                " (another kvstore-server?) or the address is not local; choose another --port"
            )
        if self.config.uds_path:
            self._bind_uds(server, self.config.uds_path)

    def _bind_uds(self, server: grpc.aio.Server, path: str) -> None:
        """Listen on the Unix-domain socket ``path`` too (same credentials as the port).

        A socket file left by a node that is gone is replaced; one that a
        live server answers on is an `OSError`. The file gets ``pool_file_mode``:
        the runners that may map the pool files may connect.
        """
        if os.path.exists(path):
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                raise OSError(f"uds_path {path} exists and is not a socket; choose another")
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(path)
                except OSError:
                    os.unlink(path)  # stale: nobody listens
                else:
                    raise OSError(f"uds_path {path}: another server listens on it")
        credentials = server_credentials(self.config)
        target = f"unix:{path}"
        try:
            bound = (
                server.add_insecure_port(target)
                if credentials is None
                else server.add_secure_port(target, credentials)
            )
        except RuntimeError:
            bound = 0
        if not bound:
            raise OSError(f"cannot listen on uds_path {path} (is its directory writable?)")
        self.uds_path = path
        os.chmod(path, self.config.pool_file_mode)

    def _bind_metrics(self) -> int:
        """Serve the metrics and the web page; `OSError` naming the port if it is taken."""
        node = self.node
        web = WebApp(node, self.history, node.metrics.wsgi_app())
        try:
            return node.metrics.start_http(self.config.host, self.config.metrics_port, web)
        except OSError as exc:
            address = _address(self.config.host, self.config.metrics_port)
            raise OSError(
                f"cannot serve metrics on {address}: {exc.strerror or exc}"
                f" (port {self.config.metrics_port}; choose another --metrics-port, 0 = off)"
            ) from None

    def _node_info(self) -> dict[str, float]:
        """Node-wide gauges for the metrics (read on the loop: the pools change there)."""
        node = self.node
        return on_loop(
            node,
            lambda: {
                "capacity_bytes": node.pools.capacity_bytes,
                "allocated_bytes": node.pools.allocated_bytes,
                "huge_page_bytes": node.pools.huge_page_bytes,
                "uptime_seconds": node.now() - node.started,
            },
        )

    def _cluster_info(self) -> dict[str, float] | None:
        """Cross-node figures for the metrics; plain counters, safe to read from any thread."""
        agent, peers = self.node.cluster, self.node.peers
        if agent is None:
            return None
        return {
            "redis_connected": float(agent.connected),
            "directory_resyncs": agent.resyncs,
            "events_dropped": agent.events_dropped,
            "peer_fetched_blocks": peers.fetched_blocks if peers is not None else 0,
            "peer_failed_fetches": peers.failed_fetches if peers is not None else 0,
            "peer_fetches_nixl": peers.fetches["nixl"] if peers is not None else 0,
            "peer_fetches_grpc": peers.fetches["grpc"] if peers is not None else 0,
        }

    async def _expire_leases(self) -> None:
        """Sleep until the next lease deadline (at most one tick), then expire."""
        node = self.node
        while True:
            deadline = node.store.next_deadline()
            delay = self.expiry_tick
            if deadline is not None:
                delay = min(delay, max(0.0, deadline - node.now()))
            await asyncio.sleep(delay)
            try:
                node.expire()
            except Exception:
                log.exception("bug: lease expiry failed")

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving: NOT_SERVING, end streams, drain for ``grace`` s, close pools."""
        grace = self.config.grace_seconds if grace is None else grace
        await self.health.enter_graceful_shutdown()
        await self.node.leave_cluster()  # leave the registry first: peers stop routing here
        await self.node.kv_events.stop()
        self.node.events.close()
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
            self._expiry = None
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None
        if self._grpc is not None:
            await self._grpc.stop(grace)
            self._grpc = None
        if self.uds_path:  # the socket file must not outlive the server
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.uds_path)
            self.uds_path = ""
        self.node.metrics.stop_http()
        if self.node.disk is not None:  # before the pools close: queued copies read them
            await self.node.disk.stop(self.config.disk_flush_seconds)
        await self.node.memory.stop()  # growth ahead of need: no arena is built after this
        self.node.pools.close()
        if self._serving:  # a node that never served did not stop: its error says why
            self._serving = False
            log.info("node %s stopped", self.node.node_id)

    async def wait_for_termination(self) -> None:
        """Wait until the gRPC server has stopped."""
        if self._grpc is not None:
            await self._grpc.wait_for_termination()

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def serve(config: Config, *, ready: asyncio.Event | None = None) -> None:
    """Run a node until SIGTERM or SIGINT, then shut it down gracefully.

    Prints ``kvstore-server listening on HOST:PORT`` (the bound port) once
    serving, then ``kvstore-server also on unix:PATH`` when ``uds_path`` is set,
    ``kvstore-server metrics on http://HOST:PORT/metrics`` when
    the metrics endpoint is on, and sets ``ready`` if given.
    """
    server = Server(config)
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stopping.set)
    # The stable lines scripts read (docs/operations.md): with --port 0 the
    # first names the port that was bound.
    print(f"kvstore-server listening on {server.address}", flush=True)
    if server.uds_path:
        print(f"kvstore-server also on unix:{server.uds_path}", flush=True)
    if server.metrics_port:
        metrics = _address(server.config.host, server.metrics_port)
        print(f"kvstore-server metrics on http://{metrics}/metrics", flush=True)
    if ready is not None:
        ready.set()
    try:
        await stopping.wait()
        log.info("shutting down (grace %.1fs)", server.config.grace_seconds)
    finally:
        await server.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)


def main(argv: Sequence[str] | None = None) -> None:
    """The ``kvstore-server`` command: configuration from flags, env and file."""
    try:
        config = load_config(argv)
    except ConfigError as exc:
        print(f"kvstore-server: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    problem = bind_problem(config.host, config.port)
    if problem is not None:  # before the node builds (and logs) anything: one line
        address = _address(config.host, config.port)
        print(
            f"kvstore-server: cannot bind the gRPC server to {address}: {problem}", file=sys.stderr
        )
        raise SystemExit(1)
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        pass
    except ConfigError as exc:  # e.g. --device cuda:0 without cupy or without that GPU
        print(f"kvstore-server: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as exc:
        print(f"kvstore-server: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
