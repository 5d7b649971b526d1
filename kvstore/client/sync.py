"""A blocking wrapper of `Client` for runners without an event loop.

`SyncClient` runs a private event loop in a daemon thread and forwards each
call to the async client there, so gRPC, the lease keepalive and cleanups
keep running between calls. Hits and namespaces are the async client's
objects; their views work from any thread.

**The caller's GPU.** torch's current device and stream are per thread, and
the loop thread's are device 0 and its default stream. Each call therefore
captures the calling thread's device and current stream and runs with them
(`kvstore.pool.cuda_caller`): the pool is attached for the caller's GPU,
`store` copies on the caller's stream and synchronises it before Commit, and
`release` waits, in the calling thread, for the reads queued on the caller's
streams before the pins are dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar

from kvstore.client.blocks import BlockSupplier
from kvstore.client.client import Client
from kvstore.client.handles import Namespace, StoreResult
from kvstore.client.hit import Hit
from kvstore.client.query import PrefixAnswer
from kvstore.hashing import Extra, HashScheme, Tokens
from kvstore.layout import KVLayout
from kvstore.pool.cuda_caller import CallerCuda, calling_thread, capture
from kvstore.v1 import kvstore_pb2 as pb

T = TypeVar("T")


class SyncClient:
    """Blocking facade of `Client`; takes the same arguments."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        """Start the loop thread and connect (see `Client` for the arguments)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvstore-client", daemon=True
        )
        self._thread.start()
        self._client = self._run(self._make(target, kwargs))
        self._closed = False

    @staticmethod
    async def _make(target: str, kwargs: dict[str, Any]) -> Client:
        client = Client(target, **kwargs)
        await client.connect()
        return client

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        call = _as_caller(capture(), coro)  # read here, in the caller's thread
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` (a call of the async `client`) on the loop without waiting for it.

        For callers that must never block on the node (an engine's scheduler):
        poll the future, or add a done callback (it runs on the loop thread).
        Cancelling the future cancels the call, which cleans up as on any
        cancellation (a pinned lookup releases what it pinned).
        """
        return asyncio.run_coroutine_threadsafe(_as_caller(capture(), coro), self._loop)

    def pins_held_until(self, hit: Hit) -> float:
        """This host's monotonic time until which ``hit``'s pins are surely held; 0.0 if not.

        Another process of this host may read the hit's slots while
        ``time.monotonic()`` is below it (checked after its copy): the node
        drops pins only when their lease expires or they are released.
        """
        if not hit.pinned or hit.released or hit.lease_id is None:
            return 0.0
        if hit.lease_generation != self._client.lease.generation:
            return 0.0  # that lease was lost, and its pins with it
        return self._client.session.surely_until(hit.lease_id)

    @property
    def client(self) -> Client:
        """The wrapped async client (use only from its loop)."""
        return self._client

    def register_namespace(
        self,
        model_id: str,
        layout: KVLayout,
        *,
        scheme: HashScheme = HashScheme.KVSTORE_SHA256,
        vllm_seed: str = "",
        capacity_bytes: int = 0,
        timeout: float | None = None,
    ) -> Namespace:
        """See `Client.register_namespace`."""
        return self._run(
            self._client.register_namespace(
                model_id,
                layout,
                scheme=scheme,
                vllm_seed=vllm_seed,
                capacity_bytes=capacity_bytes,
                timeout=timeout,
            )
        )

    def lookup(
        self,
        ns: Namespace,
        tokens: Tokens | None = None,
        *,
        hashes: Sequence[bytes] | None = None,
        extras: Sequence[Extra] | None = None,
        pin: bool = False,
        allow_remote: bool = False,
        timeout: float | None = None,
    ) -> Hit:
        """See `Client.lookup`."""
        return self._run(
            self._client.lookup(
                ns,
                tokens,
                hashes=hashes,
                extras=extras,
                pin=pin,
                allow_remote=allow_remote,
                timeout=timeout,
            )
        )

    def store(
        self,
        ns: Namespace,
        tokens: Tokens | None = None,
        blocks: BlockSupplier = (),
        *,
        hashes: Sequence[bytes] | None = None,
        extras: Sequence[Extra] | None = None,
        timeout: float | None = None,
    ) -> StoreResult:
        """See `Client.store`."""
        return self._run(
            self._client.store(ns, tokens, blocks, hashes=hashes, extras=extras, timeout=timeout)
        )

    def follow_pool(self, ns: Namespace, version: int, *, timeout: float | None = None) -> None:
        """See `Client.follow_pool`."""
        self._run(self._client.follow_pool(ns, version, timeout=timeout))

    def follow_epoch(self, ns: Namespace, epoch: int, *, timeout: float | None = None) -> None:
        """See `Client.follow_epoch`."""
        self._run(self._client.follow_epoch(ns, epoch, timeout=timeout))

    def release(
        self,
        hit: Hit,
        *,
        streams: Sequence[Any] | None = None,
        timeout: float | None = None,
        corrupt: Sequence[int] = (),
    ) -> int:
        """See `Client.release`: the GPU reads are waited for first, here in the calling thread.

        ``streams`` defaults to this thread's current streams (the loop
        thread's would be the default streams, which the runner's reads may
        not be on).
        """
        if hit.pinned and not hit.released and hit.mapping is not None:
            reads_done = hit.mapping.read_fence(streams)
            if reads_done is not None:
                reads_done()
        return self._run(self._client.release(hit, streams=(), timeout=timeout, corrupt=corrupt))

    def read_blocks(self, hit: Hit, *, timeout: float | None = None) -> list[bytes]:
        """See `Client.read_blocks`."""
        return self._run(self._client.read_blocks(hit, timeout=timeout))

    def stats(self, *, timeout: float | None = None) -> pb.StatsResponse:
        """See `Client.stats`."""
        return self._run(self._client.stats(timeout=timeout))

    def query_prefix(self, **query: Any) -> PrefixAnswer:
        """See `Client.query_prefix` (the same keyword arguments)."""
        return self._run(self._client.query_prefix(**query))

    def ping(self, payload: bytes = b"", *, timeout: float | None = None) -> bytes:
        """See `Client.ping`."""
        return self._run(self._client.ping(payload, timeout=timeout))

    def close(self, *, end_lease: bool = True) -> None:
        """Close the client, stop the loop and join its thread; idempotent.

        ``end_lease``: see `Client.close`.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._client.close(end_lease=end_lease))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    @property
    def lease_ttl(self) -> float | None:
        """See `Client.lease_ttl`."""
        return self._client.lease_ttl

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


async def _as_caller(state: CallerCuda | None, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` (its own task on the loop) with the caller's CUDA state."""
    with calling_thread(state):
        return await coro
