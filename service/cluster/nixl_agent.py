"""The node's NIXL agent: its pool memory registered once, peers' metadata, READs.

The only module that imports `nixl` (lazily, in `NixlAgent.create`), so the
light install without it keeps working. One agent per node process; its name
is the node id and the pool epoch, unique per server start, so a restarted
peer is a new agent whose metadata is loaded afresh.

**Registration** follows the pools (`service.pools.ArenaWatcher`): each arena
of a host pool is registered once when it joins its pool and deregistered
before it leaves (a shrink, a dropped namespace, shutdown), so NIXL never
holds memory that is given back. Every change raises `metadata_version`;
peers compare it with the version they loaded and reload the metadata (it
carries the registrations' remote keys) when it moved. CUDA pools are not
registered (not yet supported: their peer fetches use the gRPC stream).

**Progress, no thread**: NIXL's progress thread busy-polls a whole core
for as long as the agent lives (measured: 0.56 CPU-seconds per idle second
on this 2-core host), so it is off. UCX then advances only when asked: the
reader's polls of its transfer state do it on its side, and a holder with
offers open calls `progress` every few hundred microseconds
(`service.cluster.nixl_offers`): over TCP, UCX serves a remote READ through
active messages, which need the target's progress. An idle node costs nothing.
Every call runs on the event loop thread; none blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.pool.arenas import ArenaPool
from kvstore.pool.base import BlockPool
from kvstore.types import NamespaceId, SlotId

log = logging.getLogger(__name__)

MEM_TYPE = "DRAM"
"""NIXL memory type of host pool arenas."""

BACKEND = "UCX"
"""The NIXL backend the agent uses (shared memory on one host, RDMA or TCP between hosts)."""


class NixlUnavailable(RuntimeError):
    """NIXL cannot be used in this process (not installed, or its agent failed to start)."""


@dataclass(frozen=True, slots=True)
class Region:
    """One registered arena."""

    address: int
    """Address of the arena's first byte in this process."""
    length: int
    """Bytes registered."""
    handle: Any
    """NIXL's registration descriptor list (what `deregister_memory` takes)."""


def buffer_address(view: memoryview) -> int:
    """Address of the first byte of a writable buffer (no copy)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class Transfer:
    """One posted NIXL READ; `state` polls it, `release` frees (or aborts) it."""

    def __init__(self, agent: Any, handle: Any, state: str) -> None:
        self._agent = agent
        self._handle = handle
        self._posted = state
        self.released = False

    def state(self) -> str:
        """``"DONE"``, ``"PROC"`` (in flight) or ``"ERR"``; never blocks."""
        if self._posted != "PROC":
            return self._posted
        state: str = self._agent.check_xfer_state(self._handle)
        if state != "PROC":
            self._posted = state
        return state

    def release(self) -> bool:
        """Free the request; an in-flight one is aborted. False: NIXL could not abort it."""
        if self.released:
            return True
        try:
            self._agent.release_xfer_handle(self._handle)
        except Exception as exc:  # nixl raises its own error types
            log.warning("NIXL could not release a transfer (%s): still in flight", exc)
            return False
        self.released = True
        return True


class NixlAgent:
    """The node's NIXL agent and its registered pool arenas."""

    def __init__(self, name: str, agent: Any) -> None:
        """Wrap a started agent; use `create`."""
        self.name = name
        self._agent = agent
        self._regions: dict[NamespaceId, list[Region | None]] = {}
        self._peers: dict[str, int] = {}
        """Remote agents loaded here, with the metadata version loaded."""
        self.metadata_version = 1
        """Raised at every registration change (peers reload the metadata then)."""

    @classmethod
    def create(cls, name: str) -> NixlAgent:
        """Import nixl and start an agent with the UCX backend.

        Raises:
            NixlUnavailable: nixl is not installed or its agent cannot start.
        """
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise NixlUnavailable(
                f"nixl is not installed ({exc}): pip install kvstore[nixl]"
            ) from None
        try:
            config = nixl_agent_config(enable_prog_thread=False, backends=[BACKEND])
            agent = nixl_agent(name, config)
        except Exception as exc:  # nixl raises RuntimeError or its own types
            raise NixlUnavailable(f"the NIXL agent did not start: {exc}") from None
        if BACKEND not in agent.backends:
            raise NixlUnavailable(f"NIXL has no {BACKEND} backend here")
        return cls(name, agent)

    # --- registration (service.pools.ArenaWatcher) -------------------------------------

    def added(self, namespace: NamespaceId, pool: ArenaPool, index: int) -> None:
        """Register arena ``index`` of a namespace's pool (host pools only)."""
        regions = self._regions.setdefault(namespace, [])
        while len(regions) <= index:
            regions.append(None)
        if pool.descriptor.kind != "host":
            return  # CUDA pools: not registered (their fetches use the gRPC stream)
        length = pool.descriptor.arenas[index].size_bytes
        address = buffer_address(pool.view(SlotId(index * pool.slots_per_arena)))
        try:
            handle = self._agent.register_memory([(address, length, 0, "")], MEM_TYPE)
        except Exception as exc:
            log.warning("NIXL did not register an arena of %s (%s): gRPC for it", namespace, exc)
            return
        regions[index] = Region(address, length, handle)
        self.metadata_version += 1

    def removing(self, namespace: NamespaceId, index: int) -> None:
        """Deregister arena ``index`` of a namespace's pool before it is given back."""
        regions = self._regions.get(namespace, [])
        if index >= len(regions):
            return
        region = regions[index]
        regions[index] = None
        while regions and regions[-1] is None:
            regions.pop()
        if not regions:
            self._regions.pop(namespace, None)
        if region is not None:
            self.metadata_version += 1
            try:
                self._agent.deregister_memory(region.handle)
            except Exception:  # the arena goes back regardless; say so loudly
                log.exception("NIXL did not deregister an arena of %s", namespace)

    def slot_address(self, namespace: NamespaceId, pool: BlockPool, slot: SlotId) -> int | None:
        """Address of a slot's bytes in registered memory; None if its arena is not registered."""
        arena, offset = pool.descriptor.locate(slot)
        regions = self._regions.get(namespace, [])
        region = regions[arena] if arena < len(regions) else None
        if region is None or offset + pool.descriptor.block_bytes > region.length:
            return None
        return region.address + offset

    def progress(self) -> None:
        """Advance UCX's work (a holder serving READs); returns at once."""
        self._agent.get_new_notifs()

    # --- peers ------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata (its registrations' remote keys included) for peers."""
        data: bytes = self._agent.get_agent_metadata()
        return data

    def loaded_version(self, peer: str) -> int:
        """The version of ``peer``'s metadata loaded here (0: none)."""
        return self._peers.get(peer, 0)

    def load_peer(self, peer: str, metadata: bytes, version: int) -> None:
        """Load (or reload) a peer agent's metadata."""
        if peer in self._peers:
            self._agent.remove_remote_agent(peer)
            del self._peers[peer]
        loaded = self._agent.add_remote_agent(metadata)
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != peer:
            self._agent.remove_remote_agent(name)
            raise ValueError(f"the metadata offered as agent {peer!r} is agent {name!r}'s")
        self._peers[peer] = version

    def forget_peer(self, peer: str) -> None:
        """Unload a peer agent (it restarted under a new name, or we shut down)."""
        if self._peers.pop(peer, None) is not None:
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as exc:
                log.info("NIXL did not unload agent %s: %s", peer, exc)

    def read(self, peer: str, local: list[int], remote: list[int], length: int) -> Transfer:
        """Post one READ of ``len(local)`` blocks of ``length`` bytes from ``peer``.

        ``remote[i]`` (in the peer's registered memory) lands at ``local[i]`` (in ours).
        """
        local_descs = self._agent.get_xfer_descs([(a, length, 0) for a in local], MEM_TYPE)
        remote_descs = self._agent.get_xfer_descs([(a, length, 0) for a in remote], MEM_TYPE)
        handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, peer)
        return Transfer(self._agent, handle, self._agent.transfer(handle))

    def close(self) -> None:
        """Unload every peer and deregister every arena (the pools close after this)."""
        for peer in list(self._peers):
            self.forget_peer(peer)
        for namespace in list(self._regions):
            for index in reversed(range(len(self._regions.get(namespace, [])))):
                self.removing(namespace, index)
