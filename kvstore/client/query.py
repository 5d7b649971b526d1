"""The routers' prefix query from the SDK: `query_prefix` and what it returns.

A query is no hit: the node pins nothing, refreshes no LRU and counts no hit
(docs/cluster.md, "Prefix query for routers").
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.api import wire
from kvstore.api.prefix import PrefixAnswer, PrefixHolder
from kvstore.client import methods
from kvstore.client.rpc import Rpc
from kvstore.v1 import kvstore_pb2 as pb

__all__ = ["PrefixAnswer", "PrefixHolder", "PrefixQueries", "query_prefix"]


async def query_prefix(
    rpc: Rpc,
    *,
    model: str = "",
    namespace_id: str = "",
    tenant_id: str = "",
    tokens: Sequence[int] | None = None,
    hashes: Sequence[bytes] | None = None,
    extras: Sequence[bytes] = (),
    timeout: float | None = None,
) -> PrefixAnswer:
    """Ask the node behind ``rpc`` (see `PrefixQueries.query_prefix`).

    Raises:
        ValueError: neither or both of ``tokens`` and ``hashes``.
        KVStoreError: the node refused (bad input, unknown model or namespace,
            another tenant without the admin token).
    """
    if (tokens is None) == (hashes is None):
        raise ValueError("give tokens or hashes, exactly one")
    request = pb.QueryPrefixRequest(
        model=model, namespace_id=namespace_id, tenant_id=tenant_id, extras=extras
    )
    if tokens is not None:
        request.packed_token_ids = wire.pack_tokens(tokens)
    else:
        request.packed_hashes = wire.pack_hashes(hashes or ())
    resp = await rpc.call(methods.QUERY_PREFIX, request, timeout, idempotent=True)
    return PrefixAnswer.from_proto(resp)


class PrefixQueries:
    """`Client`'s ``query_prefix`` (a mixin: the client module stays one concept long)."""

    _rpc: Rpc

    async def query_prefix(
        self,
        *,
        model: str = "",
        namespace_id: str = "",
        tenant_id: str = "",
        tokens: Sequence[int] | None = None,
        hashes: Sequence[bytes] | None = None,
        extras: Sequence[bytes] = (),
        timeout: float | None = None,
    ) -> PrefixAnswer:
        """Who holds the longest cached prefix of a prompt: nodes, engines, tiers.

        Args:
            model: the model id (the node's one namespace for it), or
            namespace_id: the namespace.
            tenant_id: whose blocks; "" = the caller's own (another tenant
                needs the admin token when auth is on).
            tokens: the prompt's token ids (full blocks count), or
            hashes: its block hashes (32 bytes each).
            extras: per-block extra hash input (with tokens).
            timeout: deadline of the call (None: the client's default).
        """
        return await query_prefix(
            self._rpc,
            model=model,
            namespace_id=namespace_id,
            tenant_id=tenant_id,
            tokens=tokens,
            hashes=hashes,
            extras=extras,
            timeout=timeout,
        )
