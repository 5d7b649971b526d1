"""Several cache nodes used as one cache: each chain lives on one node, chosen by its first block.

A node is one process, and its event loop one core (docs/architecture.md,
"Scaling beyond one core"). To use more cores of a host, or more hosts, run
several nodes and give every runner the same list of them:
`ShardedClient` sends each chain to ``nodes[shard_of(first block hash)]``.
The first block's hash decides, so a chain and every longer chain that
extends it land on the same node (a prefix lookup never needs two nodes),
and every client with the same list, in the same order, routes a prompt to
the same node. The nodes are ordinary nodes that know nothing of each
other: each has its own memory budget, pool files, leases and metrics.

The nodes must give the same ``chain_root`` (start them with the same
``salt_secret``): hashes are computed once, here, and are valid on any of
them; `register_namespace` refuses nodes that disagree. Costs: one hot
prefix (a shared system prompt) is served by one node; a node that is down
fails the chains routed to it (no failover); admin verbs (`stats`) are per
node. A `Hit` is released through the node that pinned it, whichever
client method is given it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from kvstore.client.blocks import BlockSupplier
from kvstore.client.client import Client
from kvstore.client.handles import Namespace, StoreResult
from kvstore.client.hit import Hit
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.hashing import Extra, HashScheme, Tokens
from kvstore.layout import KVLayout
from kvstore.types import BlockHash
from kvstore.v1 import kvstore_pb2 as pb


def shard_of(first_hash: bytes, count: int) -> int:
    """The node (0 … count-1) that holds the chains starting with this block hash."""
    return int.from_bytes(first_hash[:8], "little") % count


@dataclass(frozen=True)
class ShardedNamespace:
    """One namespace registered on every node: ``parts[i]`` is node i's `Namespace`."""

    parts: tuple[Namespace, ...]

    @property
    def chain_root(self) -> BlockHash:
        """The root all the nodes agree on."""
        return self.parts[0].chain_root

    @property
    def layout(self) -> KVLayout:
        """The KV layout of every block."""
        return self.parts[0].layout

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.parts[0].block_size

    @property
    def block_bytes(self) -> int:
        """Bytes per block."""
        return self.parts[0].block_bytes

    def hash(self, tokens: Tokens, extras: Sequence[Extra] | None = None) -> list[BlockHash]:
        """Chain hashes of every full block of ``tokens``, valid on every node."""
        return self.parts[0].hash(tokens, extras)


class ShardedClient:
    """Async client of several nodes used as one cache (see the module docstring).

    ``ShardedClient(["node-a:50051", "node-b:50051"], tenant="acme")``: the
    keyword arguments are `Client`'s, given to one `Client` per node. The
    methods are `Client`'s, taking a `ShardedNamespace`.
    """

    def __init__(self, targets: Sequence[str], **options: Any) -> None:
        """One `Client` per node, in the order given (every runner must give the same order).

        Raises:
            InvalidArgument: no node, or a node listed twice.
        """
        if isinstance(targets, str) or not targets:
            raise InvalidArgument("give a list of one or more node addresses")
        if len(set(targets)) != len(targets):
            raise InvalidArgument(f"a node is listed twice in {list(targets)}")
        self.clients: tuple[Client, ...] = tuple(Client(t, **options) for t in targets)
        """The per-node clients, in routing order."""

    async def connect(self) -> None:
        """Open every node's channel."""
        await asyncio.gather(*(c.connect() for c in self.clients))

    async def close(self) -> None:
        """Close every per-node client (leases end, pools unmapped)."""
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)

    async def __aenter__(self) -> ShardedClient:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def register_namespace(
        self,
        model_id: str,
        layout: KVLayout,
        *,
        scheme: HashScheme = HashScheme.KVSTORE_SHA256,
        vllm_seed: str = "",
        capacity_bytes: int = 0,
        timeout: float | None = None,
    ) -> ShardedNamespace:
        """Register the namespace on every node (`Client.register_namespace`).

        Raises:
            FailedPrecondition: the nodes give different chain roots (they run
                with different ``salt_secret`` settings).
            AlreadyExists: a node has the model with another layout.
        """
        parts = await asyncio.gather(
            *(
                c.register_namespace(
                    model_id,
                    layout,
                    scheme=scheme,
                    vllm_seed=vllm_seed,
                    capacity_bytes=capacity_bytes,
                    timeout=timeout,
                )
                for c in self.clients
            )
        )
        roots = {p.chain_root for p in parts}
        if len(roots) != 1:
            raise FailedPrecondition(
                "the nodes give different chain roots for this namespace: start every "
                "node of a ShardedClient with the same salt_secret"
            )
        return ShardedNamespace(tuple(parts))

    def shard_of(
        self,
        ns: ShardedNamespace,
        tokens: Tokens | None = None,
        *,
        hashes: Sequence[bytes] | None = None,
        extras: Sequence[Extra] | None = None,
    ) -> int | None:
        """The node a chain goes to; None when it has no full block (any node answers).

        Raises:
            InvalidArgument: neither or both of tokens and hashes, or bad tokens.
        """
        if (tokens is None) == (hashes is None):
            raise InvalidArgument("give exactly one of tokens or hashes")
        if hashes is not None:
            first = hashes[0] if len(hashes) else None
        else:
            assert tokens is not None
            head = ns.hash(tokens[: ns.block_size], None if extras is None else extras[:1])
            first = head[0] if head else None
        return None if first is None else shard_of(first, len(self.clients))

    async def lookup(
        self,
        ns: ShardedNamespace,
        tokens: Tokens | None = None,
        *,
        hashes: Sequence[bytes] | None = None,
        extras: Sequence[Extra] | None = None,
        pin: bool = False,
        allow_remote: bool = False,
        timeout: float | None = None,
    ) -> Hit:
        """`Client.lookup` on the node that holds the chain."""
        i = self.shard_of(ns, tokens, hashes=hashes, extras=extras) or 0
        return await self.clients[i].lookup(
            ns.parts[i],
            tokens,
            hashes=hashes,
            extras=extras,
            pin=pin,
            allow_remote=allow_remote,
            timeout=timeout,
        )

    async def store(
        self,
        ns: ShardedNamespace,
        tokens: Tokens | None = None,
        blocks: BlockSupplier = (),
        *,
        hashes: Sequence[bytes] | None = None,
        extras: Sequence[Extra] | None = None,
        timeout: float | None = None,
    ) -> StoreResult:
        """`Client.store` on the node that holds the chain."""
        i = self.shard_of(ns, tokens, hashes=hashes, extras=extras) or 0
        return await self.clients[i].store(
            ns.parts[i], tokens, blocks, hashes=hashes, extras=extras, timeout=timeout
        )

    async def release(
        self,
        hit: Hit,
        *,
        streams: Sequence[Any] | None = None,
        timeout: float | None = None,
        corrupt: Sequence[int] = (),
    ) -> int:
        """`Client.release` through the node that pinned the hit."""
        owner = self._owner(hit)
        return await owner.release(hit, streams=streams, timeout=timeout, corrupt=corrupt)

    async def read_blocks(self, hit: Hit, *, timeout: float | None = None) -> list[bytes]:
        """`Client.read_blocks` from the node that pinned the hit."""
        return await self._owner(hit).read_blocks(hit, timeout=timeout)

    async def stats(self, *, timeout: float | None = None) -> list[pb.StatsResponse]:
        """Every node's `Client.stats`, in routing order."""
        return list(await asyncio.gather(*(c.stats(timeout=timeout) for c in self.clients)))

    def _owner(self, hit: Hit) -> Client:
        for client in self.clients:
            if client.owns(hit.namespace):
                return client
        raise InvalidArgument("this hit was not looked up through this ShardedClient")
