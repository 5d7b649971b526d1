"""A request's chain hashes, per tensor-parallel rank, extended as its tokens grow.

The connector keys blocks with kvstore's own scheme from each namespace's
chain root (docs/vllm.md, "Keys"): a tensor-parallel engine has one
namespace per rank, so one chain per rank. A request's chains start with
the tokens known at its first lookup (its prompt; after a preemption its
output so far too) and are extended block by block as it decodes, each
new block chained to the last one hashed (`Namespace.hash` with
``parent``): the hashes a later prompt repeating those tokens gets.
"""

from __future__ import annotations

import logging
from typing import Any

from kvstore.hashing import Extra, cbor_encode
from kvstore.integrations.vllm.node_link import NodeLink
from kvstore.types import BlockHash

log = logging.getLogger(__name__)

ExtraKeysFn = Any
"""vLLM's ``generate_block_hash_extra_keys(request, start, end, mm_index)``."""

Chains = list[list[BlockHash]]
"""One chain of hashes per rank, all of the same length."""


class RequestChains:
    """Hashes requests' full blocks in every namespace of a link."""

    def __init__(self, link: NodeLink, block_size: int, extra_keys: ExtraKeysFn) -> None:
        """``extra_keys``: vLLM's extra-key function (LoRA, multimodal, cache salt)."""
        self.link = link
        self.block_size = block_size
        self._extra_keys = extra_keys

    def extend(self, request: Any, chains: Chains | None, n_blocks: int) -> Chains | None:
        """Each rank's chain (the request's leading full blocks; None: none yet) extended
        to ``n_blocks``; None when the request cannot be keyed (no namespace yet, an extra
        key kvstore cannot encode)."""
        namespaces = self.link.namespaces()
        if namespaces is None:
            return None
        chains = chains or [[] for _ in namespaces]
        start = len(chains[0])
        if n_blocks <= start:
            return chains
        tokens = request.all_token_ids[start * self.block_size : n_blocks * self.block_size]
        try:
            extras = self._extras(request, start, n_blocks)
            return [
                chain + ns.hash(tokens, extras, parent=chain[-1] if chain else None)
                for ns, chain in zip(namespaces, chains, strict=True)
            ]
        except Exception as exc:
            log.warning("kvstore: request %s is not cached: %s", request.request_id, exc)
            return None

    def _extras(self, request: Any, start: int, end: int) -> list[Extra] | None:
        """Per-block extra hash input (LoRA name, multimodal hashes, cache salt) as bytes."""
        if not (
            getattr(request, "lora_request", None)
            or getattr(request, "mm_features", None)
            or getattr(request, "cache_salt", None)
        ):
            return None
        extras: list[Extra] = []
        mm_index = 0  # vLLM skips the inputs before a block's start itself
        for i in range(start, end):
            keys, mm_index = self._extra_keys(
                request, i * self.block_size, (i + 1) * self.block_size, mm_index
            )
            extras.append(cbor_encode(keys) if keys else None)
        return extras
