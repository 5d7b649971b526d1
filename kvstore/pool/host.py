"""Host pools: block slots in shared-memory files that runners ``mmap``.

Design decisions (also in ``docs/pools.md``):

* **Files on tmpfs.** Each arena is one file in ``directory`` (``/dev/shm`` by
  default), created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and then
  ``fchmod``-ed to ``mode`` (``0600`` by default; ``0660`` lets runners of
  the server's group attach). A mode that grants anything to *other* is
  refused: prefix-cache contents are tenants' secrets. The file is sized
  with ``ftruncate`` and mapped ``MAP_SHARED``.
* **Names carry the creator, a lock proves it alive.** Files are named
  ``{prefix}-{pid}-{epoch:x}-{namespace}-{arena}``, and the server holds a
  shared ``flock`` on each of its files until it closes the pool, so
  `cleanup_stale` can remove the files of a server that died without
  closing its pools (SIGKILL, OOM): a file whose pid is gone, or that no
  process holds locked, is stale. The lock matters in containers, where the
  next node is often pid 1 again and a pid alone would keep the dead node's
  files forever; the kernel drops a dead process's locks, whatever its pid
  namespace. The epoch keeps two pools of one process apart and tells a
  runner that a file belongs to another start.
* **Arenas, not files per block.** Slots never straddle arenas:
  ``slots_per_arena = max(1, arena_bytes // block_bytes)``,
  ``ceil(capacity / slots_per_arena)`` arenas, the last one possibly smaller.
  A runner opens and maps each arena once.
* **Pre-faulting.** With ``prefault`` the server reserves the pages with
  ``posix_fallocate`` (so a full tmpfs is a clear `LimitExceeded` at start,
  not a SIGBUS at the first write) and populates its page tables with
  ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+), falling back to touching
  one byte per page. A runner maps with ``MAP_POPULATE`` where the platform
  has it, else ``madvise(MADV_WILLNEED)``.
* **Huge pages where offered**: see `kvstore.pool.host_pages`.
* **Closing is memory safe.** ``mmap.close`` refuses while a view exported
  from it is alive; such an arena stays mapped until the last view is
  collected. The file is unlinked regardless, so the name is gone and no new
  runner can attach to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat

from kvstore.errors import InvalidArgument
from kvstore.pool import host_pages as pages
from kvstore.pool.base import (
    ArenaSpec,
    BlockPool,
    PoolDescriptor,
    PoolMapping,
    PoolUnavailable,
    plan_arenas,
)
from kvstore.pool.host_access import open_shared
from kvstore.pool.stamps import StampFile, StampReader, StampTable, stamp_file_name
from kvstore.types import NamespaceId, SlotId

DEFAULT_DIRECTORY = "/dev/shm"
"""tmpfs on every Linux host; files there live in memory."""

DEFAULT_ARENA_BYTES = 256 << 20
"""Arena size: few enough files and maps for a large pool, small enough to fit tmpfs limits."""

_OPEN_FLAGS = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def arena_file_name(prefix: str, pid: int, epoch: int, namespace: NamespaceId, index: int) -> str:
    """File name of one arena: ``{prefix}-{pid}-{epoch:x}-{namespace}-{index}``."""
    return f"{prefix}-{pid}-{epoch:x}-{namespace}-{index}"


class _Arena:
    """One mapped arena, a cached view of all of it (slicing it is cheap), its owner's lock."""

    __slots__ = ("huge_bytes", "lock_fd", "map", "view")

    def __init__(self, mapped: mmap.mmap, lock_fd: int | None = None, huge_bytes: int = 0) -> None:
        self.map = mapped
        self.view = memoryview(mapped)
        self.lock_fd = lock_fd
        """The creating server's fd holding a shared flock on the file (None in runners)."""
        self.huge_bytes = huge_bytes  # backed by huge pages after pre-faulting (0: unmeasured)

    def close(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # drops the flock: the file may now be taken for stale
            self.lock_fd = None
        self.view.release()
        # BufferError: a caller still holds a view (numpy array, tensor,
        # memoryview). The mmap object stays alive through that export and
        # unmaps when the last view is collected; closing now would dangle it.
        with contextlib.suppress(BufferError):
            self.map.close()


class HostPool(BlockPool):
    """A namespace's slots in shared-memory files owned by the server."""

    def __init__(
        self,
        descriptor: PoolDescriptor,
        arenas: list[_Arena],
        stamp_table: StampTable | None = None,
    ) -> None:
        """Wrap mapped arenas (and their stamp files); use `create`."""
        self.descriptor = descriptor
        self._arenas = arenas
        self.stamp_table = stamp_table
        self._closed = False

    @classmethod
    def create(
        cls,
        namespace: NamespaceId,
        block_bytes: int,
        capacity: int,
        epoch: int,
        *,
        directory: str = DEFAULT_DIRECTORY,
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        prefix: str = "kvstore",
        mode: int = 0o600,
        prefault: bool = True,
        group: int | None = None,
        first_index: int = 0,
        huge_pages: pages.HugePages = "auto",
    ) -> HostPool:
        """Create, size and map the arena files of a new pool.

        Args:
            namespace: the namespace the pool backs (part of the file names).
            block_bytes: bytes of one block.
            capacity: number of slots.
            epoch: the node's pool epoch (part of the file names).
            directory: where the files go; a tmpfs such as ``/dev/shm``.
            arena_bytes: target arena size; at least one slot per arena.
            prefix: file name prefix, shared with `cleanup_stale`.
            mode: file permissions; nothing for *other* (``mode & 0o007 == 0``).
            prefault: allocate and fault in every page now.
            group: gid to give the files to (the server must be a member);
                None keeps the server's group.
            first_index: number in the first arena's file name (the next ones
                count on); a pool that grows arena by arena passes a number
                unique in the epoch, so no file name is ever used twice.
            huge_pages: ask for huge pages where offered (``auto``), fail where not (``on``).

        Raises:
            InvalidArgument: a non-positive size, a world-accessible mode, a
                prefix with a path separator, huge_pages "on" where none are offered.
            LimitExceeded: the filesystem has no room for the pool.
        """
        if mode & 0o007:
            raise InvalidArgument(f"pool files must not be world accessible, got mode {mode:o}")
        slots_per_arena, arena_slots = plan_arenas(block_bytes, capacity, arena_bytes)
        if not prefix or "/" in prefix or "\0" in prefix:
            raise InvalidArgument(f"pool file prefix {prefix!r} must be a plain file name part")
        if not 0 <= epoch < 1 << 64:
            raise InvalidArgument(f"epoch must fit in 64 bits, got {epoch}")
        huge = pages.wanted(huge_pages, directory)
        pid = os.getpid()
        arenas: list[_Arena] = []
        specs: list[ArenaSpec] = []
        stamps: list[StampFile] = []
        try:
            for index, slots in enumerate(arena_slots):
                size = slots * block_bytes
                name = arena_file_name(prefix, pid, epoch, namespace, first_index + index)
                path = os.path.join(directory, name)
                stamp_path = os.path.join(directory, stamp_file_name(name))
                arenas.append(_create_arena(path, size, mode, prefault, group, huge))
                specs.append(ArenaSpec(index, size, path, stamp_path=stamp_path))
                stamps.append(StampFile.create(stamp_path, slots, mode=mode, group=group))
        except BaseException:
            for arena in arenas:
                arena.close()
            for spec in specs:
                _unlink(spec.path)
            StampTable(stamps, slots_per_arena).close()
            raise
        descriptor = PoolDescriptor(
            kind="host",
            epoch=epoch,
            namespace=namespace,
            block_bytes=block_bytes,
            capacity=capacity,
            slots_per_arena=slots_per_arena,
            arenas=tuple(specs),
        )
        return cls(descriptor, arenas, StampTable(stamps, slots_per_arena))

    def view(self, slot: SlotId) -> memoryview:
        """Writable zero-copy view of one slot, ``block_bytes`` long."""
        if self._closed:
            raise PoolUnavailable(f"the pool of namespace {self.descriptor.namespace} is closed")
        arena, offset = self.descriptor.locate(slot)
        return self._arenas[arena].view[offset : offset + self.descriptor.block_bytes]

    @property
    def closed(self) -> bool:
        """True once `close` ran."""
        return self._closed

    @property
    def huge_page_bytes(self) -> int:
        """Bytes of the pool the kernel backed with huge pages when it was pre-faulted."""
        return sum(arena.huge_bytes for arena in self._arenas)

    def close(self) -> None:
        """Unmap the arenas and unlink their files; idempotent."""
        if self._closed:
            return
        self._closed = True
        for arena in self._arenas:
            arena.close()
        for spec in self.descriptor.arenas:
            _unlink(spec.path)
        self._arenas = []
        if self.stamp_table is not None:
            self.stamp_table.close()


def _create_arena(
    path: str, size: int, mode: int, prefault: bool, group: int | None = None, huge: bool = False
) -> _Arena:
    """Create and map one arena file; on failure nothing of it is left behind.

    O_EXCL: a name that exists (another pool, a stale file) is never reused
    or truncated, and is not ours to unlink.
    """
    fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, mode)
    try:
        # At once: `cleanup_stale` takes an unlocked file for a dead server's.
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    try:
        try:
            if group is not None:
                os.fchown(fd, -1, group)  # before fchmod: chown may clear mode bits
            os.fchmod(fd, mode)  # os.open's mode is filtered by the umask; make it exact
            os.ftruncate(fd, size)
            if prefault and not huge:  # a huge page pool reserves once it is populated
                pages.reserve(fd, path, size)
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        except BaseException:
            os.close(fd)
            raise
        if huge:
            pages.advise(mapped)  # before the first fault: pages faulted small stay small
        huge_bytes = 0
        if prefault:
            pages.populate(mapped, write=True)
            if huge:
                pages.reserve(fd, path, size)
            huge_bytes = pages.mapped_huge_bytes(mapped) or 0
    except BaseException:
        _unlink(path)
        raise
    return _Arena(mapped, lock_fd=fd, huge_bytes=huge_bytes)  # fd open only to hold the lock


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class HostMapping(PoolMapping):
    """A host pool's arena files mapped into a runner process."""

    def __init__(
        self,
        descriptor: PoolDescriptor,
        arenas: list[_Arena],
        stamps: StampReader | None = None,
    ) -> None:
        """Wrap mapped arenas (and stamp files); use `open` (or `kvstore.pool.attach`)."""
        self.descriptor = descriptor
        self._arenas = arenas
        self._stamp_maps = stamps
        self._closed = False

    @classmethod
    def open(cls, descriptor: PoolDescriptor) -> HostMapping:
        """Map every arena of a host pool, read-write and shared.

        Raises:
            PoolUnavailable: an arena file is missing, is not a regular file
                or has another size. The message says which: this process
                does not see the node's directory (a container without the
                shared pool volume), the node restarted, or it dropped the
                namespace (attach again).
            PermissionDenied: this process may not open the files (run the
                runner as the node's user, or in its ``pool_file_group``).
        """
        if descriptor.kind != "host":
            raise InvalidArgument(f"HostMapping maps host pools, got kind {descriptor.kind!r}")
        arenas: list[_Arena] = []
        try:
            for spec in descriptor.arenas:
                arenas.append(_open_arena(spec, descriptor))
            stamps = StampReader.open(descriptor)
        except BaseException:
            for arena in arenas:
                arena.close()
            raise
        return cls(descriptor, arenas, stamps)

    def refresh(self, descriptor: PoolDescriptor) -> bool:
        """Follow arenas added at (or given back from) the end of this pool, in place.

        Kept arenas stay mapped, so views and hits made before stay valid;
        new ones are mapped, given-back ones unmapped. False, and nothing
        changed, when an arena this mapping holds was replaced or the
        geometry changed (a dropped namespace registered again): attach anew.

        Raises:
            InvalidArgument: ``descriptor`` is another namespace, kind or epoch.
            PoolUnavailable: the mapping is closed, or a new arena file is
                gone (given back meanwhile: attach again).
        """
        old = self.descriptor
        if (descriptor.kind, descriptor.epoch, descriptor.namespace) != (
            old.kind,
            old.epoch,
            old.namespace,
        ):
            raise InvalidArgument("refresh takes a newer descriptor of the same pool")
        if self._closed:
            raise PoolUnavailable(f"the mapping of namespace {old.namespace} is closed")
        common = min(len(old.arenas), len(descriptor.arenas))
        if (descriptor.block_bytes, descriptor.slots_per_arena) != (
            old.block_bytes,
            old.slots_per_arena,
        ) or descriptor.arenas[:common] != old.arenas[:common]:
            return False
        opened: list[_Arena] = []
        try:
            for spec in descriptor.arenas[common:]:
                opened.append(_open_arena(spec, descriptor))
            stamps = StampReader.follow(self._stamp_maps, descriptor, common)
        except BaseException:
            for arena in opened:
                arena.close()
            raise
        for arena in self._arenas[common:]:  # given back by the node
            arena.close()
        self._arenas = self._arenas[:common] + opened
        self._stamp_maps = stamps
        self.descriptor = descriptor
        return True

    def _stamp_reader(self) -> StampReader | None:
        return self._stamp_maps

    def buffer(self, slot: SlotId) -> memoryview:
        """Writable zero-copy view of one slot, ``block_bytes`` long."""
        arena, offset = self.descriptor.locate(slot)
        return self.arena_buffer(arena)[offset : offset + self.descriptor.block_bytes]

    @property
    def huge_page_bytes(self) -> int:
        """Bytes of this process's mapping backed by huge pages now (reads /proc/self/smaps)."""
        return sum(pages.mapped_huge_bytes(arena.map) or 0 for arena in self._arenas)

    def arena_buffer(self, index: int) -> memoryview:
        """Writable view of a whole arena (copies of runs of adjacent slots slice it once)."""
        if self._closed:
            raise PoolUnavailable(
                f"the mapping of namespace {self.descriptor.namespace} "
                f"(epoch {self.descriptor.epoch:x}) is closed"
            )
        return self._arenas[index].view[:]  # a slice: exports from it never block closing

    @property
    def closed(self) -> bool:
        """True once `close` ran."""
        return self._closed

    def close(self) -> None:
        """Unmap the arenas; views still referenced keep theirs alive. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for arena in self._arenas:
            arena.close()
        self._arenas = []
        if self._stamp_maps is not None:
            self._stamp_maps.close()
            self._stamp_maps = None


def _open_arena(spec: ArenaSpec, descriptor: PoolDescriptor) -> _Arena:
    if not spec.path:
        raise InvalidArgument(f"arena {spec.index} of a host pool has no file path")
    fd = open_shared(spec.path, _OPEN_FLAGS, "pool file", descriptor)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PoolUnavailable(f"pool file {spec.path} is not a regular file")
        if info.st_size != spec.size_bytes:
            raise PoolUnavailable(
                f"pool file {spec.path} is {info.st_size} bytes, the descriptor says "
                f"{spec.size_bytes}: it belongs to another server start; attach the pool again"
            )
        # Where huge pages are offered, madvise before the pages are mapped (no MAP_POPULATE).
        huge = pages.support(os.path.dirname(spec.path)).possible
        flags = mmap.MAP_SHARED | (0 if huge else getattr(mmap, "MAP_POPULATE", 0))
        mapped = mmap.mmap(fd, spec.size_bytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    if huge and pages.advise(mapped):
        pages.populate_read(mapped)
    elif huge or not hasattr(mmap, "MAP_POPULATE"):
        pages.populate(mapped, write=False)
    return _Arena(mapped)


def _locked(path: str) -> bool:
    """Whether a process holds a lock on ``path`` (True when that cannot be told)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
    except OSError:
        return True  # gone, or not ours to open: not ours to remove either
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: a live server holds it
        return True
    finally:
        os.close(fd)  # also drops the lock just taken
    return False


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def cleanup_stale(directory: str, prefix: str) -> list[str]:
    """Remove pool files left by server processes that are no longer alive.

    A file ``{prefix}-{pid}-...`` whose pid names no live process is stale;
    so is one whose pid is alive but that no process holds locked (a server
    holds a shared ``flock`` on its files while they are in use: the pid was
    recycled, or belongs to another pid namespace, as pid 1 of a container
    does). Files of live servers (this one included), files with other names
    and files this user may not remove are kept.

    Args:
        directory: where pools are created (``HostPool.create``'s directory).
        prefix: the file name prefix the pools were created with.

    Returns:
        The paths removed.
    """
    removed: list[str] = []
    head = f"{prefix}-"
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(head):
            continue
        pid_text = name[len(head) :].split("-", 1)[0]
        path = os.path.join(directory, name)
        if not pid_text.isdigit() or (_pid_alive(int(pid_text)) and _locked(path)):
            continue
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            os.unlink(path)
        except (FileNotFoundError, PermissionError):
            continue
        removed.append(path)
    return removed
