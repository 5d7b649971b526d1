"""The connector's connection to its cache node: lazy, asynchronous, out of the way when down.

vLLM must keep serving when the node is unreachable or hung (at start or at
any later time), and its scheduler thread must never wait on the node.
`NodeLink` therefore never raises a node error to its caller and never
blocks on a call, except where a caller asks to wait (`wait_namespace`, for
the worker's background threads):

- `namespace` answers at once: the registered namespace, or ``None`` while
  it is being registered (in the background) or while the node is down;
  a link may hold several namespaces registered together (`namespaces`: the
  scheduler of a tensor-parallel engine looks up each rank's);
- after any failed call (`failed`) the node is left alone for
  ``retry_interval`` seconds, so a dead node costs one timeout per
  interval, not one per request;
- `submit` starts a call of the async client on its loop and returns a
  future (the scheduler polls it: a lookup in flight is vLLM's "ask again");
- `release` drops a hit's pins in the background; the SDK sends it again
  after UNAVAILABLE or a deadline until the node answers or the lease is
  gone (`kvstore.client.releases`: the one release route). Sending it twice
  is safe: each hit's Release carries its own id, which the node applies
  once per lease, so a repeat never drops a pin that another request of
  this engine holds on the same blocks.

The client and the namespace (with its pool mapping) are made on first use
and kept; the client SDK re-registers and re-maps by itself after a node
restart.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kvstore.client import Hit, Namespace, SyncClient
from kvstore.client.errors import ServerUnavailable
from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.layout import KVLayout

log = logging.getLogger(__name__)

T = TypeVar("T")

ClientFactory = Callable[[ConnectorConfig, str], SyncClient]
"""Makes the client of a link (a seam for tests): ``(config, client_name) -> SyncClient``."""


def default_client(config: ConnectorConfig, client_name: str) -> SyncClient:
    """A `SyncClient` for ``config``, named ``client_name`` on the node."""
    return SyncClient(config.target, client_name=client_name, **config.client_kwargs())


class NodeLink:
    """One client and its namespaces on the cache node, made lazily, with a back-off."""

    def __init__(
        self,
        config: ConnectorConfig,
        model_ids: str | Sequence[str],
        layout: KVLayout | Sequence[KVLayout],
        *,
        client_name: str,
        map_pool: bool = True,
        factory: ClientFactory = default_client,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Nothing is contacted here; the first `namespace` call starts connecting.

        Args:
            model_ids: the namespace's model id, or several (one per unit:
                `kvstore.integrations.vllm.units`), registered together.
            layout: every namespace's layout, or one per model id.
        """
        self.config = config
        self.model_ids = (model_ids,) if isinstance(model_ids, str) else tuple(model_ids)
        if not self.model_ids:
            raise ValueError("a NodeLink needs at least one model id")
        self.model_id = self.model_ids[0]
        self.layouts = (
            (layout,) * len(self.model_ids) if isinstance(layout, KVLayout) else tuple(layout)
        )
        if len(self.layouts) != len(self.model_ids):
            raise ValueError(f"{len(self.layouts)} layouts for {len(self.model_ids)} model ids")
        self.layout = self.layouts[0]
        self.client_name = client_name
        self.map_pool = map_pool
        self._factory = factory
        self._clock = clock
        self._lock = threading.Lock()
        """Guards the fields below: the worker's threads share the link."""
        self._client: SyncClient | None = None
        self._namespaces: tuple[Namespace, ...] | None = None
        self._connecting: concurrent.futures.Future[list[Namespace]] | None = None
        self._down_until = 0.0
        self._warned = False
        self._closed = False

    @property
    def client(self) -> SyncClient | None:
        """The client, once made."""
        return self._client

    # --- the namespace -------------------------------------------------------------------

    def namespace(self) -> Namespace | None:
        """The registered namespace (pool mapped), or None while it is not ready; never waits.

        With several model ids: the first one's (rank 0).
        """
        namespaces = self.namespaces()
        return namespaces[0] if namespaces is not None else None

    def namespaces(self) -> tuple[Namespace, ...] | None:
        """Every model id's namespace, in order, or None while any is not ready; never waits."""
        with self._lock:
            if self._ready():
                return self._namespaces
            self._advance_connect()
            return self._namespaces if self._ready() else None

    def _ready(self) -> bool:
        return self._namespaces is not None and not any(ns.stale for ns in self._namespaces)

    @property
    def connecting(self) -> bool:
        """True while a registration is in flight (a caller may ask again soon)."""
        future = self._connecting
        return future is not None and not future.done()

    def wait_namespace(self, timeout: float) -> Namespace | None:
        """`namespace`, waiting up to ``timeout`` for a registration in flight.

        Only for threads that may block (the worker's load and save threads),
        never for vLLM's scheduler or forward path.
        """
        namespaces = self.wait_namespaces(timeout)
        return namespaces[0] if namespaces is not None else None

    def wait_namespaces(self, timeout: float) -> tuple[Namespace, ...] | None:
        """`namespaces`, waiting up to ``timeout`` for a registration in flight (only
        for threads that may block, as `wait_namespace`)."""
        namespaces = self.namespaces()
        future = self._connecting
        if namespaces is not None or future is None:
            return namespaces
        concurrent.futures.wait([future], timeout=timeout)
        return self.namespaces()

    def _advance_connect(self) -> None:
        """Collect a finished registration, or start one (lock held)."""
        future = self._connecting
        if future is not None:
            if not future.done():
                return
            self._connecting = None
            try:
                namespaces = future.result()
            except (KVStoreError, concurrent.futures.CancelledError, OSError) as exc:
                self._failed("connect", exc)
                return
            if self.map_pool and any(ns.mapping is None for ns in namespaces):
                self._failed("map the pool of", KVStoreError("no pool mapping"))
                return
            self._namespaces = tuple(namespaces)
            if self._warned:
                self._back()
            else:
                log.info(
                    "kvstore: %s registered namespace %s on node %s",
                    self.client_name,
                    ", ".join(self.model_ids),
                    self.config.target,
                )
            return
        if self._closed or self._clock() < self._down_until:
            return
        try:
            if self._client is None:
                self._client = self._factory(self.config, self.client_name)
            self._connecting = self._client.submit(self._register(self._client))
        except KVStoreError as exc:
            self._failed("connect", exc)

    async def _register(self, client: SyncClient) -> list[Namespace]:
        calls = [
            client.client.register_namespace(
                model_id,
                layout,
                capacity_bytes=self.config.capacity_bytes,
                timeout=self.config.connect_timeout,
            )
            for model_id, layout in zip(self.model_ids, self.layouts, strict=True)
        ]
        return list(await asyncio.gather(*calls))

    # --- calls -------------------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T] | None:
        """Start a call of the async client without waiting; None when there is no client."""
        client = self._client
        if client is None or self._closed:
            coro.close()
            return None
        return client.submit(coro)

    def failed(self, what: str, exc: BaseException) -> None:
        """Record a failed call: leave the node alone for ``retry_interval`` seconds."""
        with self._lock:
            self._failed(what, exc)

    def _failed(self, what: str, exc: BaseException) -> None:
        self._down_until = self._clock() + self.config.retry_interval
        level = logging.DEBUG if self._warned else logging.WARNING
        log.log(
            level,
            "kvstore: could not %s node %s (%s: %s); computing without the cache for %.0f s",
            what,
            self.config.target,
            type(exc).__name__,
            exc,
            self.config.retry_interval,
        )
        self._warned = True

    def succeeded(self) -> None:
        """A call went through: after failures were warned about, say once that the node
        is back (later failures are warned about again, not hidden at DEBUG)."""
        if not self._warned:
            return
        with self._lock:
            if self._warned:
                self._back()

    def _back(self) -> None:
        """The node answers again after warned failures (lock held): say so, once."""
        self._warned = False
        log.warning("kvstore node %s is back; reusing cached prefixes", self.config.target)

    @property
    def down(self) -> bool:
        """True while the node is left alone after a failure."""
        return self._clock() < self._down_until

    # --- pins --------------------------------------------------------------------------

    def pins_held_until(self, hit: Hit) -> float:
        """This host's monotonic time until which ``hit``'s pins are surely held (0: not)."""
        client = self._client
        return client.pins_held_until(hit) if client is not None else 0.0

    def release(self, hit: Hit, corrupt: Sequence[int] = ()) -> None:
        """Drop ``hit``'s pins in the background (see the module docstring); never waits.

        ``corrupt``: indices of hit blocks whose bytes failed their checksum in a
        worker's load: the node checks and drops them (`Client.release`).
        """
        client = self._client
        if client is None or hit.released or not hit.pinned:
            return
        self.submit(self._release(client, hit, corrupt))

    async def _release(self, client: SyncClient, hit: Hit, corrupt: Sequence[int]) -> None:
        try:
            # The worker's copies finished before it reported the load: nothing to wait
            # for on any stream. A release the node does not answer is sent again by
            # the SDK (same id) until it answers or the lease is gone.
            await client.client.release(
                hit, streams=(), timeout=self.config.lookup_timeout, corrupt=corrupt
            )
        except ServerUnavailable as exc:
            self.failed("release pins on", exc)
        except KVStoreError as exc:  # the lease is gone (its pins with it), or a bug
            log.debug("kvstore: release failed: %s", exc)

    # --- life cycle --------------------------------------------------------------------

    def close(self, *, end_lease: bool = True) -> None:
        """Close the client; idempotent.

        Args:
            end_lease: end the lease on the node now (pins dropped, writes aborted);
                False leaves it to expire by itself (nothing renews it any more), so
                pins another process copies from hold as long as it was told.
        """
        with self._lock:
            self._closed = True
            client, self._client, self._namespaces = self._client, None, None
            connecting, self._connecting = self._connecting, None
        if connecting is not None:
            connecting.cancel()
        if client is not None:
            try:
                client.close(end_lease=end_lease)
            except Exception as exc:  # shutting down: nothing left to do about it
                log.debug("kvstore client close failed: %s", exc)
