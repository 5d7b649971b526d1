"""The prefix query for routers: who holds the longest cached prefix of a prompt.

Transport-free: the gRPC handler (`service.api.query`) and the HTTP route
``POST /query`` (`service.ops.web`) both turn their request into a
`PrefixQuery` and their caller into a `Caller`, and call `answer`.

- The namespace is named by model id (the one namespace registered for it on
  this node) or by namespace id; an unknown one is `UnknownNamespace`
  (NOT_FOUND / 404), a model with several namespaces here (several layouts)
  asks for the namespace id (INVALID_ARGUMENT / 400).
- The tenant (`query_tenant`): a tenant token asks for its own tenant only;
  the admin token may name any tenant of the tenants file; with auth off
  (trust mode) the request may name any tenant, like the tenant header.
- The prompt is token ids (hashed here with the tenant's chain root, full
  blocks only) or block hashes, bounded like Lookup's (`service.api.chains`).
- With a cluster (Redis), the answer comes from the directory in one round
  trip (`Directory.query`: node pools and engines of live nodes, this node
  included as the directory has it); standalone, or while Redis is away,
  from this node alone (source ``"local"``): its store, peeked (no pin, no
  LRU move, no hit counted), and its engines (``node.engine_index`` when
  the engine-event ingestion is present), and its disk tier (tier ``"disk"``:
  the blocks a lookup would serve from its pool and its disk together). The
  directory does not list disk tiers yet (docs/disk.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.api.prefix import (
    DISK_TIER,
    ENGINE_TIER,
    NODE_TIER,
    SOURCE_DIRECTORY,
    SOURCE_LOCAL,
    PrefixAnswer,
    PrefixHolder,
)
from kvstore.block_table import BlockTable
from kvstore.errors import InvalidArgument, PermissionDenied, UnknownNamespace
from kvstore.types import BlockHash, NamespaceId, TenantId
from service.api import chains, validate
from service.api.errors import FieldError
from service.cluster.directory import TierHolder
from service.cluster.redis_link import REDIS_ERRORS
from service.node import Node
from service.tenancy.callers import TENANT_HEADER, Caller

log = logging.getLogger(__name__)

_FIELD_NAMES = {
    "tokens": "token_ids",
    "hashes": "block_hashes",
    "packed_tokens": "packed_token_ids",
}
"""`service.api.chains` names Lookup's fields; the query's are named after Conductor's."""


@dataclass(frozen=True, slots=True)
class PrefixQuery:
    """One query, as decoded from gRPC or JSON (not yet checked)."""

    model: str = ""
    """Model id; "" when ``namespace_id`` names the namespace."""
    namespace_id: str = ""
    """Namespace id; "" when ``model`` names it."""
    tenant_id: str = ""
    """The tenant asked about; "" = the caller's own."""
    tokens: chains.Tokens = ()
    """Token ids of the prompt (exclusive with ``hashes``)."""
    hashes: Sequence[bytes] = ()
    """Block hashes of the prompt (exclusive with ``tokens``)."""
    hashes_checked: bool = False
    """``hashes`` were unpacked from packed bytes: 32 bytes each and bounded already."""
    extras: Sequence[bytes] = ()
    """Per-block extra hash input (tokens only)."""


def query_tenant(node: Node, caller: Caller, named: str) -> TenantId:
    """The tenant whose blocks a query asks about (the auth rule of docs/security.md).

    Raises:
        PermissionDenied: a tenant token naming another tenant.
        FieldError: the admin naming no tenant or one not in the tenants file;
            a malformed tenant name.
    """
    if caller.admin:
        if not named:
            raise FieldError("tenant_id", "the admin token names no tenant: name one")
        tenant = _tenant_name(node, named)
        if node.directory is not None and node.directory.policy(tenant) is None:
            raise FieldError("tenant_id", f"{named[:64]!r} is not a tenant of this node")
        return tenant
    if node.tenants.auth_on:
        if named and named != caller.tenant:
            raise PermissionDenied(
                f"a tenant token queries its own tenant ({caller.tenant!r}) only; "
                "the admin token may name any tenant"
            )
        return caller.tenant
    return _tenant_name(node, named) if named else caller.tenant


def _tenant_name(node: Node, named: str) -> TenantId:
    try:
        return node.tenants.resolve([(TENANT_HEADER, named)])
    except InvalidArgument as exc:  # it names the header: name the field instead
        message = str(exc).removeprefix(f"{TENANT_HEADER} ")
        raise FieldError("tenant_id", message) from None


def _query_field(name: str) -> str:
    """The query's name of a Lookup field in an error (``hashes[3]``: ``block_hashes[3]``)."""
    for lookup, query in _FIELD_NAMES.items():
        if name == lookup or name.startswith(f"{lookup}["):
            return query + name[len(lookup) :]
    return name


def query_table(node: Node, model: str, namespace_id: str) -> BlockTable:
    """The namespace a query names, by id or by model id (`Node.tables_of_model`: the
    exact id, or the model a vLLM engine serves).

    Raises:
        FieldError: neither named, a malformed id, a model that disagrees with
            the id, or a model with several namespaces on this node.
        UnknownNamespace: nothing registered here by that id or model.
    """
    if namespace_id:
        table = node.table(validate.namespace_id(namespace_id))
        if model and table.spec.model_id != model:
            raise FieldError(
                "model",
                f"{model[:128]!r} is not the model of namespace {namespace_id} "
                f"({table.spec.model_id!r}); send one of them",
            )
        return table
    if not model:
        raise FieldError("model", "name the model (or the namespace_id) to query")
    tables = node.tables_of_model(model)
    if not tables:
        raise UnknownNamespace(
            f"no namespace is registered for model {model[:128]!r} on this node "
            "(a runner registers it; or name the namespace_id)"
        )
    if len(tables) > 1:
        ids = ", ".join(sorted(t.namespace for t in tables))
        raise FieldError(
            "model", f"{model[:128]!r} has {len(tables)} namespaces here ({ids}): name namespace_id"
        )
    return tables[0]


async def answer(node: Node, caller: Caller, query: PrefixQuery) -> PrefixAnswer:
    """Who holds the longest prefix of ``query``'s prompt (see the module docstring).

    Raises:
        KVStoreError: bad input (`FieldError`), unknown namespace, a tenant
            asking about another; mapped to status codes by the caller.
    """
    tenant = query_tenant(node, caller, query.tenant_id)
    table = query_table(node, query.model, query.namespace_id)
    node.check_model(tenant, table.spec.model_id)
    config = node.config
    root = node.root(table, tenant) if len(query.tokens) else BlockHash(b"")
    try:
        chain, query_tokens, _ = await chains.chain(
            root,
            table.block_size,
            table.spec.scheme,
            query.tokens,
            query.hashes,
            query.extras,
            max_blocks=config.max_chain_blocks,
            max_tokens=config.max_request_tokens,
            hashes_checked=query.hashes_checked,
        )
    except FieldError as exc:
        raise FieldError(_query_field(exc.field), exc.description) from None
    scope = table.scope_of(tenant)
    found = await _from_directory(node, table.namespace, scope, chain)
    source = SOURCE_DIRECTORY
    if found is None:
        found, source = _from_node(node, table.namespace, tenant, scope, chain), SOURCE_LOCAL
    size = table.block_size
    holders = tuple(
        PrefixHolder(
            node_id=h.node_id,
            address=h.address,
            tier=(h.medium or ENGINE_TIER) if h.engine else (h.medium or NODE_TIER),
            engine=h.engine,
            matched_blocks=h.blocks,
            matched_tokens=h.blocks * size,
        )
        for h in found
    )
    return PrefixAnswer(
        namespace_id=table.namespace,
        model=table.spec.model_id,
        tenant_id=tenant,
        block_size=size,
        query_blocks=len(chain),
        query_tokens=query_tokens,
        source=source,
        holders=holders,
    )


async def _from_directory(
    node: Node, namespace: NamespaceId, scope: TenantId, chain: list[BlockHash]
) -> list[TierHolder] | None:
    """The directory's holders; None without a cluster or while Redis is away."""
    agent = node.cluster
    if agent is None or not agent.connected or agent.client is None:
        return None
    try:
        async with asyncio.timeout(node.config.redis_timeout):
            return await agent.directory.query(agent.client, namespace, scope, chain)
    except REDIS_ERRORS as exc:
        log.debug("prefix query: Redis failed (%s); answering from this node", exc)
        return None


def _from_node(
    node: Node, namespace: NamespaceId, tenant: TenantId, scope: TenantId, chain: list[BlockHash]
) -> list[TierHolder]:
    """This node's pool (peeked: no pin, no LRU move, no hit counted) and engines."""
    if not chain:
        return []
    address = node.cluster.address if node.cluster is not None else node.config.advertise_address
    found: list[TierHolder] = []
    hit = node.store.lookup(namespace, tenant, chain, node.now(), peek=True).hit_blocks
    if hit:
        found.append(TierHolder(node.node_id, address, hit))
    if node.disk is not None:  # what a lookup would promote: memory's run, then the disk's
        on_disk = node.disk.run_after(node.table(namespace).spec, scope, chain, hit)
        if on_disk:
            found.append(TierHolder(node.node_id, address, hit + on_disk, medium=DISK_TIER))
    index = node.engine_index
    if index is not None:
        for match in index.longest(namespace, scope, chain):
            if match.blocks > 0:
                found.append(
                    TierHolder(node.node_id, address, match.blocks, match.engine, match.medium)
                )
    found.sort(key=lambda h: (-h.blocks, h.node_id, h.engine))
    return found
