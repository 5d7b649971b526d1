"""CUDA arenas taken out of a pool but kept until no runner can still have them mapped.

A runner maps a CUDA arena with ``cudaIpcOpenMemHandle`` and keeps it open
until it follows a newer arena set. CUDA leaves freeing an exported
allocation while another process still has it open undefined, so an arena
that the node takes out of a pool (given back under memory pressure, or its
namespace dropped) is *held* here, its memory still counted as allocated,
until every live lease that may map it has moved on:

- Runners say what they map: the pool version of each namespace they have
  mapped (`OpenLease`, every `KeepAlive`, authoritative), and an
  `AttachPool` under a lease adds the version it had mapped before (or the
  one it attaches).
- An arena taken out when the namespace's pool got version ``gone_at`` is
  mapped by a runner only if it follows that namespace at a version below
  ``gone_at``; once no live lease does (they reported a newer version, or
  stopped mapping the namespace, or ended), it is freed.

Host pools are not held: unlinking a shared-memory file leaves the mappings
of it valid. A runner that maps a pool without holding a lease is not
tracked (the SDK opens its lease before it reads: views need a pin).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from kvstore.ops.plural import plural
from kvstore.pool.base import BlockPool
from kvstore.types import LeaseId, NamespaceId

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Held:
    namespace: NamespaceId
    arena: BlockPool
    gone_at: int
    """The namespace pool's version from which on the arena is no longer part of it."""
    nbytes: int


class HeldArenas:
    """Arenas out of their pools, and what each lease reported it maps."""

    def __init__(self) -> None:
        self._held: list[_Held] = []
        self._follows: dict[LeaseId, dict[NamespaceId, int]] = {}
        self.freed = 0
        """Arenas freed after being held (for tests and metrics)."""

    @property
    def held_bytes(self) -> int:
        """Bytes of the arenas held now."""
        return sum(h.nbytes for h in self._held)

    @property
    def count(self) -> int:
        """Arenas held now."""
        return len(self._held)

    def namespaces(self) -> set[NamespaceId]:
        """The namespaces with an arena held now."""
        return {h.namespace for h in self._held}

    def hold(self, namespace: NamespaceId, arena: BlockPool, gone_at: int, nbytes: int) -> None:
        """Keep ``arena`` (out of ``namespace``'s pool from version ``gone_at``) until unused."""
        self._held.append(_Held(namespace, arena, gone_at, nbytes))
        self.collect()

    def report(self, lease_id: LeaseId, versions: Mapping[str, int]) -> None:
        """What ``lease_id``'s runner maps now (replaces what it reported before)."""
        self._follows[lease_id] = {NamespaceId(ns): int(v) for ns, v in versions.items() if v}
        self.collect()

    def attached(self, lease_id: LeaseId, namespace: NamespaceId, version: int) -> None:
        """``lease_id``'s runner maps ``namespace`` at ``version`` (or an older one it reported)."""
        follows = self._follows.setdefault(lease_id, {})
        follows[namespace] = min(follows.get(namespace, version), version)

    def lease_ended(self, lease_id: LeaseId) -> None:
        """A lease ended: its runner's mappings no longer hold anything."""
        if self._follows.pop(lease_id, None) is not None:
            self.collect()

    def collect(self) -> int:
        """Free every held arena no live lease may map; returns how many."""
        if not self._held:
            return 0
        keep: list[_Held] = []
        freed = 0
        for held in self._held:
            if any(
                follows.get(held.namespace, held.gone_at) < held.gone_at
                for follows in self._follows.values()
            ):
                keep.append(held)
                continue
            try:
                held.arena.close()
            except Exception:
                log.exception("freeing a held arena of namespace %s failed", held.namespace)
            freed += 1
        self._held = keep
        self.freed += freed
        if freed:
            log.info(
                "freed %s no runner maps any more (%d still held)",
                plural(freed, "arena"),
                len(keep),
            )
        return freed

    def close(self) -> None:
        """Free everything (the node is stopping: its runners' handles are going stale)."""
        held, self._held = self._held, []
        self._follows.clear()
        for h in held:
            try:
                h.arena.close()
            except Exception:
                log.exception("freeing a held arena of namespace %s failed", h.namespace)
