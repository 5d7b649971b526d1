"""QueryPrefix: the routers' prefix query over gRPC, translated (`service.api.prefix_query`)."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.api import wire
from kvstore.types import HASH_BYTES
from kvstore.v1 import kvstore_pb2 as pb
from service.api import chains
from service.api.base import ServicerBase
from service.api.decode import Context
from service.api.errors import FieldError, guard_unary
from service.api.prefix_query import PrefixQuery, answer


def query_from_proto(request: pb.QueryPrefixRequest, max_blocks: int) -> PrefixQuery:
    """The `PrefixQuery` of a request: repeated or packed token ids or hashes.

    Raises:
        FieldError: a field and its packed form both set, or a packed field of
            the wrong length (hashes: over ``max_blocks`` too).
    """
    tokens: chains.Tokens = request.token_ids
    if request.packed_token_ids:
        if len(tokens):
            raise FieldError("packed_token_ids", "send token_ids or packed_token_ids, not both")
        tokens = chains.unpacked(wire.unpack_tokens, request.packed_token_ids, "packed_token_ids")
    hashes: Sequence[bytes] = request.block_hashes
    checked = False
    if request.packed_hashes:
        if len(hashes):
            raise FieldError("packed_hashes", "send block_hashes or packed_hashes, not both")
        count = len(request.packed_hashes) // HASH_BYTES
        if count > max_blocks:
            raise FieldError(
                "packed_hashes", f"names {count} blocks, at most {max_blocks} (max_chain_blocks)"
            )
        hashes = chains.unpacked(wire.unpack_hashes, request.packed_hashes, "packed_hashes")
        checked = True
    return PrefixQuery(
        model=request.model,
        namespace_id=request.namespace_id,
        tenant_id=request.tenant_id,
        tokens=tokens,
        hashes=hashes,
        hashes_checked=checked,
        extras=request.extras,
    )


class QueryRpcs(ServicerBase):
    """The routers' RPC of the KVStore service."""

    @guard_unary("QueryPrefix")
    async def QueryPrefix(
        self, request: pb.QueryPrefixRequest, context: Context
    ) -> pb.QueryPrefixResponse:
        """Who holds the longest prefix of a prompt: nodes, engines, tiers (no hit counted)."""
        node = self.node
        caller = node.caller(context)
        query = query_from_proto(request, node.config.max_chain_blocks)
        return (await answer(node, caller, query)).to_proto()
