"""The engine index: which blocks each serving engine of this node holds, in kvstore hashes.

An engine (vLLM) publishes its prefix-cache blocks keyed by its own hashes.
To answer "where is the longest cached prefix of this chain" per engine,
each BlockStored is re-keyed into kvstore's chain hashes of the namespace
registered for the engine's model: the first block chains from the kvstore
hash of the engine's parent block (kept per engine: engine hash -> kvstore
hash), or from the tenant's chain root when the event has no parent; then
block by block with the namespace's hash function over the event's token ids
(`kvstore.hashing.hash_blocks`, as a Lookup with tokens does).

Skipped and counted, never guessed (a wrong key would credit an engine
with someone else's prefix):

- ``unknown_parent``: the parent is not indexed (events were missed);
- ``no_namespace``: the model is not registered on this node yet;
- ``no_tokens`` / ``block_size``: token ids missing, or not block_size per
  block of the namespace (a partial block);
- ``extra_keys``: blocks hashed with LoRA / multimodal / cache-salt keys
  (the published, untagged keys do not give back vLLM's hash input);
- ``other_group``: KV-cache groups other than 0 (hybrid models);
- ``over_limit``: the engine already has ``engine_max_blocks`` blocks.

BlockRemoved drops blocks from the medium it names; AllBlocksCleared (or a
publisher restart) drops the engine's blocks. Synchronous bookkeeping only,
driven from the node's event loop; changes for Redis go to an optional
`EngineSetQueue` that the Redis agent drains.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from kvstore.hashing import HashScheme, hash_blocks
from kvstore.types import BlockHash, NamespaceId, TenantId
from service.cluster.directory import Change
from service.cluster.engine_sets import EngineEntry, EngineSetQueue
from service.cluster.keys import member
from service.config.engines import EngineSource
from service.vllm_events.wire import Batch, Cleared, EngineHash, Removed, Stored

log = logging.getLogger(__name__)

DEFAULT_MEDIUM = "GPU"
"""The medium of events that name none (vLLM's prefix cache lives on the GPU)."""


@dataclass(frozen=True, slots=True)
class EngineMatch:
    """An engine holding a prefix of a chain."""

    engine: str
    """Engine name (`EngineSource.name`)."""
    medium: str
    """Where it holds the blocks ("GPU", "CPU", ...)."""
    blocks: int
    """Length of the chain prefix it holds there (at least 1)."""


@dataclass(frozen=True, slots=True)
class ChainStart:
    """How an engine's blocks are keyed: its model's namespace, seen by its tenant."""

    namespace: NamespaceId
    scope: TenantId
    root: BlockHash
    block_size: int
    scheme: HashScheme


Resolve = Callable[[str, str], ChainStart | None]
"""(model_id, tenant) -> the namespace's chain start, None while it is not registered."""


@dataclass(slots=True)
class _Entry:
    kv: BlockHash
    media: set[str]


@dataclass(slots=True)
class EngineState:
    """One engine's blocks and counters."""

    source: EngineSource
    start: ChainStart | None = None
    """The namespace the blocks below belong to (bound at the first BlockStored)."""
    entries: dict[EngineHash, _Entry] = field(default_factory=dict)
    held: dict[str, set[BlockHash]] = field(default_factory=dict)
    """Per medium, the kvstore hashes held there."""
    counts: dict[str, int] = field(default_factory=dict)
    """Batches, blocks stored/removed, clears, restarts, gaps and every skip reason."""
    last_seq: int | None = None
    """Sequence number of the last batch ingested (the subscriber's)."""

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    @property
    def medium(self) -> str:
        """The media it holds blocks in, comma-joined (the Redis hash field's "medium")."""
        return ",".join(sorted(m for m, held in self.held.items() if held)) or DEFAULT_MEDIUM


class EngineIndex:
    """Blocks of every configured engine, keyed by kvstore chain hashes."""

    def __init__(self, sources: Sequence[EngineSource], resolve: Resolve, max_blocks: int) -> None:
        self.engines = {s.name: EngineState(s) for s in sources}
        self._resolve = resolve
        self.max_blocks = max_blocks
        self.queue: EngineSetQueue | None = None
        """Changes for Redis; set by the Redis agent when the node has a cluster."""
        self._told: set[tuple[str, str]] = set()

    # --- queries ----------------------------------------------------------------

    def longest(
        self, namespace_id: str, scope: bytes | str, chain: Sequence[bytes]
    ) -> list[EngineMatch]:
        """Engines holding a prefix of ``chain`` in ``namespace_id`` and ``scope``, longest first.

        ``scope`` is the directory scope (the tenant; empty in shared
        namespaces), as bytes or text. Only engines with at least one block.
        """
        scope_text = scope.decode() if isinstance(scope, bytes) else scope
        matches = []
        for name, state in self.engines.items():
            start = state.start
            if start is None or start.namespace != namespace_id or start.scope != scope_text:
                continue
            for medium, held in state.held.items():
                n = 0
                for h in chain:
                    if h not in held:
                        break
                    n += 1
                if n:
                    matches.append(EngineMatch(name, medium, n))
        matches.sort(key=lambda m: (-m.blocks, m.engine, m.medium))
        return matches

    def holders(self, namespace_id: str, scope: str, block: bytes) -> list[str]:
        """Engines holding one block (any medium), for ListBlocks."""
        return [
            name
            for name, state in self.engines.items()
            if state.start is not None
            and state.start.namespace == namespace_id
            and state.start.scope == scope
            and any(block in held for held in state.held.values())
        ]

    def blocks(self, engine: str) -> list[tuple[BlockHash, tuple[str, ...]]]:
        """An engine's blocks: (kvstore hash, media), for ops tools (`KeyError` if unknown)."""
        state = self.engines[engine]
        return [(e.kv, tuple(sorted(e.media))) for e in state.entries.values()]

    def status(self) -> list[dict[str, object]]:
        """Per engine: namespace, media, block counts and counters (JSON-ready)."""
        out: list[dict[str, object]] = []
        for name, state in self.engines.items():
            out.append(
                {
                    "engine": name,
                    "model_id": state.source.model_id,
                    "namespace": state.start.namespace if state.start else "",
                    "blocks": {m: len(h) for m, h in state.held.items() if h},
                    "last_seq": state.last_seq,
                    "counts": dict(sorted(state.counts.items())),
                }
            )
        return out

    def entries(self) -> list[EngineEntry]:
        """Every engine's set (a Redis resync writes these)."""
        out = []
        for name, state in self.engines.items():
            if state.start is None or not state.entries:
                continue
            scope = state.start.scope
            members = tuple({member(e.kv, scope) for e in state.entries.values()})
            out.append(EngineEntry(state.start.namespace, name, state.medium, members))
        return out

    def live_sets(self) -> list[tuple[NamespaceId, str, str]]:
        """The (namespace, engine, medium) of every engine holding blocks (heartbeat)."""
        return [
            (state.start.namespace, name, state.medium)
            for name, state in self.engines.items()
            if state.start is not None and state.entries
        ]

    # --- ingest -----------------------------------------------------------------

    def ingest(self, engine: str, batch: Batch) -> None:
        """Apply one batch of an engine's events."""
        state = self.engines[engine]
        state.count("batches")
        for event in batch.events:
            if isinstance(event, Stored):
                self._stored(state, event)
            elif isinstance(event, Removed):
                self._removed(state, event)
            elif isinstance(event, Cleared):
                state.count("cleared")
                self.clear(engine)

    def clear(self, engine: str) -> None:
        """Forget every block of ``engine`` (AllBlocksCleared, a publisher restart)."""
        state = self.engines[engine]
        self._queue(state, Change.REMOVE, [e.kv for e in state.entries.values()])
        state.entries.clear()
        state.held.clear()

    def skip(self, engine: str, reason: str, n: int, detail: str) -> None:
        """Count ``n`` skipped items of ``engine``; log the first of each reason."""
        self.engines[engine].count(reason, n)
        if (engine, reason) not in self._told:
            self._told.add((engine, reason))
            log.warning(
                "engine %s: %s (%s; counted from now on, not logged)", engine, detail, reason
            )

    def _stored(self, state: EngineState, ev: Stored) -> None:
        name, n = state.source.name, len(ev.block_hashes)
        if not n:
            return
        if ev.group_idx not in (None, 0):
            self.skip(name, "other_group", n, "blocks of KV-cache group > 0 are not indexed")
            return
        if ev.lora_name is not None or (ev.extra_keys and any(k for k in ev.extra_keys)):
            self.skip(name, "extra_keys", n, "blocks with LoRA/multimodal/salt keys skipped")
            return
        start = self._bind(state)
        if start is None:
            self.skip(name, "no_namespace", n, f"model {state.source.model_id!r} not registered")
            return
        if not ev.token_ids:
            self.skip(name, "no_tokens", n, "BlockStored without token_ids")
            return
        if ev.block_size != start.block_size or len(ev.token_ids) != n * start.block_size:
            self.skip(
                name,
                "block_size",
                n,
                f"BlockStored of block_size {ev.block_size} with {len(ev.token_ids)} tokens for "
                f"{n} blocks; the namespace's block size is {start.block_size}",
            )
            return
        if ev.parent is None:
            parent = start.root
        else:
            known = state.entries.get(ev.parent)
            if known is None:
                self.skip(name, "unknown_parent", n, "BlockStored whose parent is not indexed")
                return
            parent = known.kv
        fresh = [h for h in ev.block_hashes if h not in state.entries]
        if len(state.entries) + len(fresh) > self.max_blocks:
            self.skip(name, "over_limit", n, f"over engine_max_blocks ({self.max_blocks})")
            return
        try:
            kv = hash_blocks(parent, ev.token_ids, start.block_size, scheme=start.scheme)
        except InvalidArgument as exc:
            self.skip(name, "bad_tokens", n, f"token ids not hashable: {exc}")
            return
        medium = ev.medium or DEFAULT_MEDIUM
        held = state.held.setdefault(medium, set())
        added = []
        for engine_hash, kv_hash in zip(ev.block_hashes, kv, strict=True):
            entry = state.entries.get(engine_hash)
            if entry is None:
                entry = state.entries[engine_hash] = _Entry(kv_hash, set())
                added.append(kv_hash)
            entry.media.add(medium)
            held.add(entry.kv)
        state.count("stored_blocks", n)
        self._queue(state, Change.ADD, added)

    def _removed(self, state: EngineState, ev: Removed) -> None:
        medium = ev.medium or DEFAULT_MEDIUM
        held = state.held.get(medium, set())
        gone = []
        for engine_hash in ev.block_hashes:
            entry = state.entries.get(engine_hash)
            if entry is None or medium not in entry.media:
                continue
            entry.media.discard(medium)
            held.discard(entry.kv)
            if not entry.media:
                del state.entries[engine_hash]
                gone.append(entry.kv)
        state.count("removed_blocks", len(ev.block_hashes))
        self._queue(state, Change.REMOVE, gone)

    def _bind(self, state: EngineState) -> ChainStart | None:
        """The engine's chain start now; a namespace changed since: forget the old blocks."""
        start = self._resolve(state.source.model_id, state.source.tenant)
        if start is not None and state.start is not None and start != state.start:
            self.clear(state.source.name)
        if start is not None:
            state.start = start
        return start

    def _queue(self, state: EngineState, change: Change, hashes: Sequence[BlockHash]) -> None:
        if self.queue is None or state.start is None or not hashes:
            return
        members = [member(h, state.start.scope) for h in hashes]
        self.queue.put(change, state.start.namespace, state.source.name, state.medium, members)
