"""The node's NIXL agent: its pool memory registered once, peers' metadata, READs.

The only module that imports `nixl` (lazily, in `NixlAgent.create`), so the
light install without it keeps working. One agent per node process; its name
is the node id and the pool epoch, unique per server start, so a restarted
peer is a new agent whose metadata is loaded afresh.

**Registration** follows the pools (`service.memory.budget.ArenaWatcher`): each arena
of a host pool is registered once when it joins its pool and deregistered
before it leaves (a shrink, a dropped namespace, shutdown), so NIXL never
holds memory that is given back. Every change raises `metadata_version`;
peers compare it with the version they loaded and reload the metadata (it
carries the registrations' remote keys) when it moved. CUDA pools are not
registered (not yet supported: their peer fetches use the gRPC stream).

**Progress only while moving bytes**: NIXL's own progress thread
busy-polls a whole core for as long as the agent lives (measured: 0.56
CPU-seconds per idle second on this 2-core host), so it is off, and UCX
advances only when asked. A READ is waited for in a worker thread that polls
its state every `POLL_SECONDS` (each poll advances UCX on the reader's
side), and a holder with offers open runs a `ProgressPump` thread that
advances it as often: UCX serves a remote READ through active messages over
TCP and rendezvous copies (``cma``), which need the holder's progress too.
The event loop's own timers are too coarse for this (epoll waits whole
milliseconds: a 128 MiB READ took 3-4x longer when driven from the loop).
An idle node costs nothing. The agent runs in NIXL's strict thread-safety
mode, since the loop and these threads call it.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.pool.arenas import ArenaPool
from kvstore.pool.base import BlockPool
from kvstore.types import NamespaceId, SlotId

log = logging.getLogger(__name__)

MEM_TYPE = "DRAM"
"""NIXL memory type of host pool arenas."""

POLL_SECONDS = 50e-6
"""Pause between two progress calls of a READ's waiter and of a holder's pump."""

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


@dataclass(frozen=True, slots=True)
class Place:
    """Where a block's bytes are: its arena (a registration) and its address."""

    arena: int
    """Index of the arena in its pool."""
    address: int
    """Address of the block's first byte (in the process that owns the arena)."""


def buffer_address(view: memoryview) -> int:
    """Address of the first byte of a writable buffer (no copy)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class XferState(enum.Enum):
    """Where one NIXL READ is; NIXL's own strings are the values.

    ``NEW`` --post--> ``PROC`` --poll--> ``DONE`` | ``ERR``; a post may end it
    at once (``DONE`` | ``ERR``). ``DONE`` and ``ERR`` are final: `Transfer`
    moves through `advance`, which refuses anything else.
    """

    NEW = "NEW"
    """Made, not posted."""
    PROC = "PROC"
    """Posted, in flight: its bytes may still land."""
    DONE = "DONE"
    """Every byte landed."""
    ERR = "ERR"
    """Failed (posting, polling, or a peer that went away)."""

    @classmethod
    def of_nixl(cls, state: str) -> XferState:
        """NIXL's answer of ``transfer`` / ``check_xfer_state``; anything else is a failure."""
        try:
            return cls(state)
        except ValueError:
            log.info("NIXL answered an unknown transfer state %r: a failure", state)
            return cls.ERR

    def advance(self, to: XferState) -> XferState:
        """``to``, when this state may move there (or stay); else a `RuntimeError` (a bug)."""
        if to is self or to in _MOVES[self]:
            return to
        raise RuntimeError(f"bug: a NIXL transfer cannot move from {self.name} to {to.name}")


_MOVES: dict[XferState, frozenset[XferState]] = {
    XferState.NEW: frozenset({XferState.PROC, XferState.DONE, XferState.ERR}),
    XferState.PROC: frozenset({XferState.DONE, XferState.ERR}),
    XferState.DONE: frozenset(),
    XferState.ERR: frozenset(),
}
"""The moves `XferState.advance` allows."""


class Transfer:
    """One NIXL READ: `wait` posts it and polls it, `release` frees (or aborts) it."""

    def __init__(self, agent: Any, handle: Any) -> None:
        self._agent = agent
        self._handle = handle
        self._state = XferState.NEW
        self.released = False

    def state(self) -> XferState:
        """Its state now, asking NIXL while it is in flight; never blocks.

        NIXL reports some failures by raising (a peer that disconnected):
        they are ``ERR`` here, never an exception.
        """
        if self._state is not XferState.PROC:
            return self._state
        try:
            state = XferState.of_nixl(self._agent.check_xfer_state(self._handle))
        except Exception as exc:  # nixl raises e.g. nixlRemoteDisconnectError: a failure
            log.info("NIXL READ failed: %s", exc)
            state = XferState.ERR
        self._state = self._state.advance(state)
        return state

    def wait(self, deadline: float, stop: threading.Event) -> XferState:
        """Post, then poll until the transfer ends, ``deadline`` (monotonic) or ``stop``.

        Blocking: runs in a worker thread (posting alone copies much of the
        bytes over shared memory: 30 ms for 128 MiB here). Returns the end
        state, ``PROC`` when it gave up with the transfer in flight, or
        ``NEW`` when ``stop`` was set before it posted anything.
        """
        if self._state is XferState.NEW and not stop.is_set():
            try:
                posted = XferState.of_nixl(self._agent.transfer(self._handle))
            except Exception as exc:  # e.g. the peer is gone: a failure, nothing in flight
                log.info("NIXL did not post a READ: %s", exc)
                posted = XferState.ERR
            self._state = self._state.advance(posted)
        while not stop.is_set():
            state = self.state()
            if state is not XferState.PROC or time.monotonic() >= deadline:
                return state
            time.sleep(POLL_SECONDS)
        return self.state()

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
        # The nixl wheels' UCX "efa" module links the system's libibverbs, which
        # loads a second libnl-route beside the wheel's own: the two crash the
        # process at exit (SIGSEGV in rtnl_tc_unregister, after a clean stop).
        # Left out unless the operator chooses UCX's modules (on EFA hosts).
        os.environ.setdefault("UCX_MODULES", "^efa")
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as exc:
            raise NixlUnavailable(
                f"nixl is not installed ({exc}): pip install kvstore[nixl]"
            ) from None
        try:
            config = nixl_agent_config(
                enable_prog_thread=False,
                backends=[BACKEND],
                sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            )
            agent = nixl_agent(name, config)
        except Exception as exc:  # nixl raises RuntimeError or its own types
            raise NixlUnavailable(f"the NIXL agent did not start: {exc}") from None
        if BACKEND not in agent.backends:
            raise NixlUnavailable(f"NIXL has no {BACKEND} backend here")
        return cls(name, agent)

    # --- registration (service.memory.budget.ArenaWatcher) ----------------------------

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

    def slot_address(self, namespace: NamespaceId, pool: BlockPool, slot: SlotId) -> Place | None:
        """Where a slot's bytes are in registered memory; None if its arena is not registered."""
        arena, offset = pool.descriptor.locate(slot)
        regions = self._regions.get(namespace, [])
        region = regions[arena] if arena < len(regions) else None
        if region is None or offset + pool.descriptor.block_bytes > region.length:
            return None
        return Place(arena, region.address + offset)

    def progress(self) -> None:
        """Advance UCX's work (a holder serving READs); returns at once. Thread-safe."""
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

    def read(self, peer: str, local: list[Place], remote: list[Place], length: int) -> Transfer:
        """Prepare one READ of ``len(local)`` blocks of ``length`` bytes from ``peer``.

        ``remote[i]`` (in the peer's registered memory) lands at ``local[i]``
        (in ours). Blocks adjacent on both sides, each side within one arena,
        travel as one descriptor: a chain stored in one go usually sits in
        consecutive slots on both nodes, and each descriptor costs UCX a
        rendezvous round trip. (A descriptor must lie within one registration,
        and two arenas may well be adjacent in memory: hence the arena check.)

        Raises:
            Exception: NIXL's own errors (e.g. an address in no registration).
        """
        runs = coalesce(local, remote, length)
        local_descs = self._agent.get_xfer_descs([(a, n, 0) for a, _, n in runs], MEM_TYPE)
        remote_descs = self._agent.get_xfer_descs([(b, n, 0) for _, b, n in runs], MEM_TYPE)
        handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, peer)
        return Transfer(self._agent, handle)

    def close(self) -> None:
        """Unload every peer and deregister every arena (the pools close after this)."""
        for peer in list(self._peers):
            self.forget_peer(peer)
        for namespace in list(self._regions):
            for index in reversed(range(len(self._regions.get(namespace, [])))):
                self.removing(namespace, index)


def coalesce(local: list[Place], remote: list[Place], length: int) -> list[tuple[int, int, int]]:
    """(local, remote, bytes) runs: blocks adjacent on both sides, in one arena each, merged."""
    runs: list[tuple[int, int, int]] = []
    previous: tuple[Place, Place] | None = None
    for a, b in zip(local, remote, strict=True):
        if runs and previous is not None:
            la, lb, n = runs[-1]
            pa, pb = previous
            same_arenas = a.arena == pa.arena and b.arena == pb.arena
            if same_arenas and la + n == a.address and lb + n == b.address:
                runs[-1] = (la, lb, n + length)
                previous = (a, b)
                continue
        runs.append((a.address, b.address, length))
        previous = (a, b)
    return runs


class ProgressPump:
    """A thread advancing an agent's UCX work until a deadline (a holder's open offers)."""

    def __init__(self, agent: NixlAgent) -> None:
        self._agent = agent
        self._until = 0.0
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run_until(self, deadline: float) -> None:
        """Keep advancing until ``deadline`` (monotonic; a later one extends it)."""
        with self._lock:
            self._until = max(self._until, deadline)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._pump, name="kvstore-nixl-progress", daemon=True
                )
                self._thread.start()

    def stop(self) -> None:
        """Stop advancing now (no offers open); the thread ends within a poll."""
        with self._lock:
            self._until = 0.0

    def _pump(self) -> None:
        while True:
            with self._lock:
                if time.monotonic() >= self._until:
                    self._thread = None
                    return
            try:
                self._agent.progress()
            except Exception:
                log.exception("NIXL progress failed")
                with self._lock:
                    self._thread = None
                return
            time.sleep(POLL_SECONDS)
