"""The connector's connection to its cache node: lazy, and out of the way when down.

vLLM must keep serving when the node is unreachable (at start or at any
later time). `NodeLink` therefore never raises a node error to its caller:
`namespace` returns ``None`` while the node is down, and after any failed
call (`failed`) the node is left alone for ``retry_interval`` seconds, so a
dead node costs one timeout per interval, not one per request. The client
and the namespace (with its pool mapping) are made on first use and kept;
the client SDK re-registers and re-maps by itself after a node restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvstore.client import Namespace, SyncClient
from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.layout import KVLayout

log = logging.getLogger(__name__)

ClientFactory = Callable[[ConnectorConfig, str], SyncClient]
"""Makes the client of a link (a seam for tests): ``(config, client_name) -> SyncClient``."""


def default_client(config: ConnectorConfig, client_name: str) -> SyncClient:
    """A `SyncClient` for ``config``, named ``client_name`` on the node."""
    return SyncClient(config.target, client_name=client_name, **config.client_kwargs())


class NodeLink:
    """One client and one namespace on the cache node, made lazily, with a back-off."""

    def __init__(
        self,
        config: ConnectorConfig,
        model_id: str,
        layout: KVLayout,
        *,
        client_name: str,
        map_pool: bool = True,
        factory: ClientFactory = default_client,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Nothing is contacted here; the first `namespace` call connects."""
        self.config = config
        self.model_id = model_id
        self.layout = layout
        self.client_name = client_name
        self.map_pool = map_pool
        self._factory = factory
        self._clock = clock
        self._client: SyncClient | None = None
        self._namespace: Namespace | None = None
        self._down_until = 0.0
        self._warned = False

    @property
    def client(self) -> SyncClient | None:
        """The client, once made."""
        return self._client

    def namespace(self) -> Namespace | None:
        """The registered namespace (pool mapped), or None while the node is unusable."""
        if self._namespace is not None and not self._namespace.stale:
            return self._namespace
        if self._clock() < self._down_until:
            return None
        try:
            if self._client is None:
                self._client = self._factory(self.config, self.client_name)
            self._namespace = self._client.register_namespace(
                self.model_id,
                self.layout,
                capacity_bytes=self.config.capacity_bytes,
                timeout=self.config.connect_timeout,
            )
        except KVStoreError as exc:
            self.failed("connect", exc)
            return None
        if self.map_pool and self._namespace.mapping is None:
            self.failed("map the pool of", KVStoreError("no pool mapping"))
            return None
        if self._warned:
            log.warning("kvstore node %s is back; reusing cached prefixes", self.config.target)
            self._warned = False
        return self._namespace

    def failed(self, what: str, exc: BaseException) -> None:
        """Record a failed call: leave the node alone for ``retry_interval`` seconds."""
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

    def close(self) -> None:
        """Close the client (ends its lease: pins dropped, writes aborted); idempotent."""
        client, self._client, self._namespace = self._client, None, None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # shutting down: nothing left to do about it
                log.debug("kvstore client close failed: %s", exc)
