"""The client's transport: one gRPC channel, its metadata, deadlines and retries.

Every call of the SDK goes through `Rpc.call` (unary), `Rpc.send`
(client-streaming) or `Rpc.stream` (server-streaming), which add the tenant
and token metadata and the deadline, send idempotent calls through the
`RetryPolicy`, and turn gRPC errors into `kvstore` errors. Each takes its RPC
as a typed constant of `kvstore.client.methods`, so mypy checks the request
and the reply of every call. `Rpc.call` is the seam tests wrap to slow or
fail single calls.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, cast

import grpc

from kvstore.client.errors import error_from_rpc
from kvstore.client.methods import ClientStream, Rep, Req, ServerStream, Unary
from kvstore.client.retry import RetryPolicy
from kvstore.client.tls import TLSOptions
from kvstore.errors import FailedPrecondition
from kvstore.v1 import kvstore_pb2_grpc

if TYPE_CHECKING:  # the async stub's class exists in the generated .pyi only
    from kvstore.v1.kvstore_pb2_grpc import KVStoreAsyncStub

ChannelOption = tuple[str, str | int]
"""A gRPC channel argument (``("grpc.max_receive_message_length", 1 << 26)``)."""

TENANT_HEADER = "x-kvstore-tenant"
"""Metadata key naming the caller's tenant."""


class Rpc:
    """The channel to one node and the calls over it."""

    def __init__(
        self,
        target: str,
        *,
        tenant: str | None,
        token: str | None,
        timeout: float,
        retry: RetryPolicy,
        options: Sequence[ChannelOption],
        tls: TLSOptions | None,
    ) -> None:
        """Configure the transport; the channel opens in `connect`."""
        self.target = target
        self.timeout = timeout
        """Default deadline of every call, in seconds."""
        self._retry = retry
        self._options = list(options)
        self._tls = tls
        metadata: list[tuple[str, str]] = []
        if tenant:
            metadata.append((TENANT_HEADER, tenant))
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        self._metadata = tuple(metadata)
        self._channel: grpc.aio.Channel | None = None
        self._stub: KVStoreAsyncStub | None = None

    @property
    def channel(self) -> grpc.aio.Channel | None:
        """The open channel, None before `connect` and after `close`."""
        return self._channel

    async def connect(self) -> None:
        """Open the channel (idempotent)."""
        if self._channel is None:
            if self._tls is None:
                self._channel = grpc.aio.insecure_channel(self.target, options=self._options)
            else:
                credentials = self._tls.credentials()
                self._channel = grpc.aio.secure_channel(self.target, credentials, self._options)
            self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)

    async def close(self) -> None:
        """Close the channel (idempotent)."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None

    def _stub_method(self, name: str) -> object:
        if self._stub is None:
            raise FailedPrecondition("the client is not connected; use `async with Client(...)`")
        return getattr(self._stub, name)

    async def call(
        self,
        method: Unary[Req, Rep],
        request: Req,
        timeout: float | None,
        *,
        idempotent: bool,
    ) -> Rep:
        """One unary call; idempotent ones are retried by the `RetryPolicy`.

        Args:
            method: the RPC (`kvstore.client.methods.LOOKUP`, ...).
            request: its request message.
            timeout: deadline of the call, retries included (None: the default).
            idempotent: safe to repeat (a pinned Lookup, Reserve, Commit are not).

        Raises:
            KVStoreError: the call failed (`error_from_rpc`).
        """
        # The table's name is the stub's attribute of that type: tests/client/
        # test_methods.py checks every entry against the service descriptor.
        stub_method = cast(
            "grpc.aio.UnaryUnaryMultiCallable[Req, Rep]", self._stub_method(method.name)
        )
        deadline = self.timeout if timeout is None else timeout

        async def attempt(remaining: float | None) -> Rep:
            return await stub_method(request, timeout=remaining, metadata=self._metadata)

        try:
            if idempotent:
                # Hand-written, not a service-config retryPolicy: see kvstore.client.retry.
                return await self._retry.call(attempt, deadline)
            return await attempt(deadline)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err

    async def send(
        self, method: ClientStream[Req, Rep], requests: AsyncIterator[Req], timeout: float | None
    ) -> Rep:
        """One client-streaming call (never retried: the stream is consumed once).

        Raises:
            KVStoreError: the call failed (`error_from_rpc`).
        """
        stub_method = cast(
            "grpc.aio.StreamUnaryMultiCallable[Req, Rep]", self._stub_method(method.name)
        )
        deadline = self.timeout if timeout is None else timeout
        try:
            return await stub_method(requests, timeout=deadline, metadata=self._metadata)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err

    async def stream(
        self, method: ServerStream[Req, Rep], request: Req, timeout: float | None
    ) -> AsyncIterator[Rep]:
        """The messages of a server-streaming call (never retried: it may be half read).

        Raises:
            KVStoreError: the call failed (`error_from_rpc`).
        """
        stub_method = cast(
            "grpc.aio.UnaryStreamMultiCallable[Req, Rep]", self._stub_method(method.name)
        )
        deadline = self.timeout if timeout is None else timeout
        try:
            async for item in stub_method(request, timeout=deadline, metadata=self._metadata):
                yield item
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err
