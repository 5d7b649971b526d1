"""The stamp table of a pool: each slot's (generation, ident) in host shared memory.

What a stamp means and when it changes is the core's business
(`kvstore.stamps`); this module owns the bytes. Layout (``docs/pools.md``,
"Slot stamps"):

* **One file per arena**, next to the arena (host pools) or in the host
  pool directory (CUDA pools: a runner reads stamps without touching the
  GPU), named after the arena's file name with ``-stamps`` appended, so it
  shares its prefix, pid, epoch and number, its mode and group, its
  ``flock`` and `cleanup_stale`. It is created and unlinked with its arena.
* **16 bytes per slot** of the arena, slot *i* at byte ``16 * i``: the
  generation (uint64, little-endian), then the ident (uint64). A new file is
  zeros: never stamped.
* **Writes** (the node, `StampFile.stamp`) are aligned 8-byte stores, the
  ident first and the generation last. **Reads** (runners, `StampReader`)
  copy both words; a reader compares its expected stamp before and after its
  copy, so a read torn between two writes only looks like a moved block
  (every write carries a new generation), never like an intact one.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
import sys

import numpy as np
import numpy.typing as npt

from kvstore.errors import InvalidArgument
from kvstore.pool.base import PoolDescriptor, PoolUnavailable
from kvstore.pool.host_access import open_shared

STAMP_BYTES = 16
"""Bytes of one slot's stamp: generation then ident, two little-endian uint64."""

STAMP_SUFFIX = "-stamps"
"""Appended to an arena's file name to name its stamp file."""

_STAMP_DTYPE = np.dtype("<u8")

if sys.byteorder != "little":  # the writer's native stores must be the file's byte order
    raise ImportError("kvstore's stamp tables need a little-endian host")


def stamp_file_name(arena_name: str) -> str:
    """File name of the stamp file of the arena named ``arena_name``."""
    return arena_name + STAMP_SUFFIX


class StampFile:
    """The node's side of one arena's stamps: a mapped file it holds locked."""

    __slots__ = ("_lock_fd", "_map", "_words", "path", "slots")

    def __init__(self, path: str, slots: int, mapped: mmap.mmap, lock_fd: int) -> None:
        """Wrap a created file; use `create`."""
        self.path = path
        self.slots = slots
        self._map = mapped
        self._words = memoryview(mapped).cast("Q")  # native = little-endian (checked above)
        self._lock_fd: int | None = lock_fd

    @classmethod
    def create(cls, path: str, slots: int, *, mode: int, group: int | None) -> StampFile:
        """Create, lock, size and map a zeroed stamp file of ``slots`` slots.

        ``O_CREAT | O_EXCL | O_NOFOLLOW``, a shared ``flock`` at once (a
        file nobody holds locked is stale to `cleanup_stale`), then the exact
        ``mode`` and ``group``, like the arena files.
        """
        if mode & 0o007:
            raise InvalidArgument(f"stamp files must not be world accessible, got mode {mode:o}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            if group is not None:
                os.fchown(fd, -1, group)  # before fchmod: chown may clear mode bits
            os.fchmod(fd, mode)
            os.ftruncate(fd, slots * STAMP_BYTES)
            mapped = mmap.mmap(fd, slots * STAMP_BYTES, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        return cls(path, slots, mapped, fd)

    def stamp(self, local: int, generation: int, ident: int) -> None:
        """Write the stamp of the arena's slot ``local``: the ident, then the generation."""
        if self._lock_fd is None:  # closed: the stamps went with the file
            return
        words = self._words
        words[2 * local + 1] = ident
        words[2 * local] = generation

    def read(self, local: int) -> tuple[int, int]:
        """The (generation, ident) of slot ``local`` (for tests and tools)."""
        return self._words[2 * local], self._words[2 * local + 1]

    def close(self) -> None:
        """Unlink, unmap and drop the lock; idempotent."""
        if self._lock_fd is None:
            return
        _unlink(self.path)
        self._words.release()
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self._lock_fd)
        self._lock_fd = None


class StampTable:
    """The node's stamps of a one- or many-arena pool: a `kvstore.stamps.StampSink`."""

    __slots__ = ("files", "slots_per_arena")

    def __init__(self, files: list[StampFile], slots_per_arena: int) -> None:
        """Stamps of arenas of ``slots_per_arena`` slots (the last may hold fewer)."""
        self.files = files
        self.slots_per_arena = slots_per_arena

    def stamp(self, slot: int, generation: int, ident: int) -> None:
        """Write ``slot``'s stamp (the generation word last)."""
        arena, local = divmod(slot, self.slots_per_arena)
        self.files[arena].stamp(local, generation, ident)

    def read(self, slot: int) -> tuple[int, int]:
        """The (generation, ident) of ``slot`` as written (for tests and tools)."""
        arena, local = divmod(slot, self.slots_per_arena)
        return self.files[arena].read(local)

    def close(self) -> None:
        """Close every file (unlinking it); idempotent."""
        for file in self.files:
            file.close()


class StampReader:
    """A runner's read-only mappings of a pool's stamp files, one per arena."""

    __slots__ = ("_arrays", "_maps", "slots_per_arena")

    def __init__(self, maps: list[mmap.mmap], slots_per_arena: int) -> None:
        """Wrap mapped files; use `open`."""
        self._maps = maps
        self._arrays = [np.frombuffer(m, dtype=_STAMP_DTYPE).reshape(-1, 2) for m in maps]
        self.slots_per_arena = slots_per_arena

    @classmethod
    def open(cls, descriptor: PoolDescriptor) -> StampReader | None:
        """Map the stamp files of every arena; None when the node sends none (an older node).

        Raises:
            PoolUnavailable: a stamp file is missing or of another size.
            PermissionDenied: this process may not open one.
        """
        if not all(spec.stamp_path for spec in descriptor.arenas):
            return None
        return cls(_open_all(descriptor, 0), descriptor.slots_per_arena)

    @classmethod
    def follow(
        cls, old: StampReader | None, descriptor: PoolDescriptor, common: int
    ) -> StampReader | None:
        """The reader of a newer arena set whose first ``common`` arenas ``old`` maps.

        Those stay mapped (their stamp files are the same); the rest are opened.
        """
        if old is None or not all(spec.stamp_path for spec in descriptor.arenas):
            return cls.open(descriptor)
        opened = _open_all(descriptor, common)
        kept, gone = old._maps[:common], old._maps[common:]
        old._arrays, old._maps = [], []  # the new reader takes over what stays
        for mapped in gone:  # arenas given back
            with contextlib.suppress(BufferError):
                mapped.close()
        return cls(kept + opened, old.slots_per_arena)

    def read(self, slots: npt.ArrayLike) -> npt.NDArray[np.uint64]:
        """The stamps of ``slots``: shape ``(n, 2)``, columns generation and ident.

        Raises:
            InvalidArgument: a slot outside the mapped arenas.
        """
        wanted = np.asarray(slots, dtype=np.int64).reshape(-1)
        out = np.empty((len(wanted), 2), dtype=np.uint64)
        if not len(wanted):
            return out
        arenas, local = np.divmod(wanted, self.slots_per_arena)
        arrays = self._arrays
        if wanted.min() < 0 or arenas.max() >= len(arrays):
            raise InvalidArgument(f"a slot of {wanted.tolist()} is outside the mapped pool")
        try:
            first = int(arenas[0])
            if (arenas == first).all():  # the common case: one arena, one gather
                out[:] = arrays[first][local]
            else:
                for arena in np.unique(arenas).tolist():
                    at = arenas == arena
                    out[at] = arrays[arena][local[at]]
        except IndexError as exc:  # past the end of a smaller last arena
            raise InvalidArgument(
                f"a slot of {wanted.tolist()} is outside the mapped pool"
            ) from exc
        return out

    def moved(
        self, slots: npt.ArrayLike, generations: npt.ArrayLike, idents: npt.ArrayLike
    ) -> npt.NDArray[np.intp]:
        """Indices of ``slots`` whose stamp now is not ``(generations[i], idents[i])``."""
        return moved(self.read(slots), generations, idents)

    def close(self) -> None:
        """Drop the mappings (arrays still referenced keep theirs); idempotent."""
        self._arrays = []
        for mapped in self._maps:
            with contextlib.suppress(BufferError):
                mapped.close()
        self._maps = []


def moved(
    stamps: npt.NDArray[np.uint64],
    generations: npt.ArrayLike,
    idents: npt.ArrayLike,
) -> npt.NDArray[np.intp]:
    """Indices of the rows of ``stamps`` (from `StampReader.read`) that are not as expected.

    Args:
        stamps: ``(n, 2)`` stamps read now.
        generations: the READY generations the lookup answered, ``n`` of them.
        idents: the blocks' idents (`idents_of`), ``n`` of them.
    """
    expected_g = np.asarray(generations, dtype=np.uint64)
    expected_i = np.asarray(idents, dtype=np.uint64)
    return np.flatnonzero((stamps[:, 0] != expected_g) | (stamps[:, 1] != expected_i))


def idents_of(packed_hashes: bytes, hash_bytes: int = 32) -> npt.NDArray[np.uint64]:
    """The ident of each hash in ``packed_hashes`` (concatenated): its first 8 bytes, LE.

    The vector form of `kvstore.stamps.stamp_ident`.
    """
    if len(packed_hashes) % hash_bytes:
        raise InvalidArgument(f"{len(packed_hashes)} bytes are not whole {hash_bytes}-byte hashes")
    rows = np.frombuffer(packed_hashes, dtype=np.uint8).reshape(-1, hash_bytes)
    return np.ascontiguousarray(rows[:, :8]).view(_STAMP_DTYPE).reshape(-1).astype(np.uint64)


def _open_all(descriptor: PoolDescriptor, start: int) -> list[mmap.mmap]:
    maps: list[mmap.mmap] = []
    try:
        for index in range(start, len(descriptor.arenas)):
            size = descriptor.slots_in_arena(index) * STAMP_BYTES
            maps.append(_open_one(descriptor.arenas[index].stamp_path, size, descriptor))
    except BaseException:
        for mapped in maps:
            mapped.close()
        raise
    return maps


def _open_one(path: str, size: int, descriptor: PoolDescriptor) -> mmap.mmap:
    fd = open_shared(path, os.O_RDONLY | os.O_CLOEXEC, "stamp file", descriptor)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < size:
            raise PoolUnavailable(
                f"stamp file {path} is not a regular file of {size} bytes: it belongs to "
                "another server start; attach the pool again"
            )
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
