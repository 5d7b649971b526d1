"""What the client hands to runners: namespaces and store results.

A `Namespace` is the client's live handle on a registered namespace: its
layout, its chain root for the caller's tenant and, once attached, the
mapping of its pool. The client refreshes a handle in place when the node's
pool epoch changes, so a runner may keep it for the life of the client.

A `StoreResult` is what `Client.store` did with each block of a chain. The
answer of a lookup, `Hit`, is a concept of its own: `kvstore.client.hit`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.hashing import Extra, HashScheme, Tokens, hash_blocks
from kvstore.layout import KVLayout, NamespaceSpec
from kvstore.pool import PoolMapping
from kvstore.types import BlockHash, NamespaceId


@dataclass(slots=True, eq=False)
class Namespace:
    """A registered namespace as this client sees it (refreshed on epoch changes)."""

    spec: NamespaceSpec
    """What was registered: model id, layout, hash scheme."""
    id: NamespaceId
    """The node's id of the namespace."""
    block_bytes: int
    """Bytes per block."""
    capacity: int
    """Slots of its pool on the node."""
    chain_root: BlockHash
    """Root of the hash chain for this client's tenant."""
    shared: bool
    """True when tenants share blocks in this namespace."""
    mapping: PoolMapping | None = field(default=None, repr=False)
    """The attached pool, or None (not attached, or dropped on an epoch change)."""
    stale: bool = False
    """True after an epoch change, until the client registers it again."""
    verify_loads: bool = False
    """The node asks runners to check the bytes of every hit they load against its
    checksums (its ``verify_checksums`` is "all"): see `Hit.check_bytes`."""

    @property
    def layout(self) -> KVLayout:
        """The KV layout of every block."""
        return self.spec.layout

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.spec.layout.block_size

    @property
    def scheme(self) -> HashScheme:
        """How block hashes are chained."""
        return self.spec.scheme

    @property
    def epoch(self) -> int | None:
        """Pool epoch of the current mapping, None when not attached."""
        if self.mapping is None or self.mapping.closed:
            return None
        return self.mapping.descriptor.epoch

    def hash(
        self,
        tokens: Tokens,
        extras: Sequence[Extra] | None = None,
        *,
        parent: BlockHash | None = None,
    ) -> list[BlockHash]:
        """Chain hashes of every full block of ``tokens``, computed locally.

        Args:
            tokens: token ids; a partial last block is ignored.
            extras: optional per-block extra input, one per full block.
            parent: the hash of the block just before ``tokens`` when they continue
                a chain (a request's output after its prompt); default: the
                namespace's chain root, i.e. ``tokens`` start at token 0.
        """
        root = self.chain_root if parent is None else parent
        return hash_blocks(root, tokens, self.block_size, scheme=self.scheme, extras=extras)


@dataclass(frozen=True, slots=True)
class StoreResult:
    """What `Client.store` did with each full block of the chain."""

    reserved: int
    """Blocks this call reserved (and then wrote)."""
    hit: int
    """Blocks already cached: nothing to write."""
    in_flight: int
    """Blocks another lease is writing: they will appear."""
    no_room: int
    """Blocks the pool had no room for."""
    committed: int
    """Blocks made READY by this call."""
    chain: tuple[BlockHash, ...] = ()
    """Every full block's hash, in chain order."""
