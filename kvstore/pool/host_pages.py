"""How a host arena's pages are allocated and faulted in: reserve, populate, huge pages.

`reserve` allocates a new arena file's pages (so a full tmpfs fails at
once, not with a SIGBUS at a later write) and `populate` faults a mapping's
pages in. The rest of this module is about their size.

Copies out of a pool mapped with 4 KiB pages run at about half the speed of
copies between huge-page-backed arrays (TLB misses). A pool file on tmpfs
gets 2 MiB pages when the kernel's shmem policy allows them
(``mm/shmem.c``):

* ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` is ``[deny]``: never;
  ``[force]``: always, on every tmpfs.
* Otherwise the tmpfs mount decides: ``huge=always`` or ``huge=within_size``
  give huge pages to any large enough file, ``huge=advise`` to mappings
  that ``madvise(MADV_HUGEPAGE)``, and ``huge=never`` (the default, as for
  ``/dev/shm`` on most hosts) never. The other ``shmem_enabled`` values
  apply to the kernel's internal mount (memfd, SysV shm), not to
  ``/dev/shm``.

So `support` reads both, the node and each runner ``madvise`` their
mappings ``MADV_HUGEPAGE`` where it says huge pages are possible (before
faulting the pages in: pages faulted as 4 KiB stay so; the node then
reserves the file only after populating it, as ``posix_fallocate`` on a
``huge=advise`` tmpfs would allocate small pages), and
`mapped_huge_bytes` reads ``/proc/self/smaps`` to tell how much of a
mapping the kernel actually backs with huge pages (``ShmemPmdMapped``): a
host with no free 2 MiB pages falls back to small ones silently. To get huge
pages on a host whose ``/dev/shm`` has none, mount a tmpfs with
``huge=within_size`` and point ``shm_dir`` at it (``docs/pools.md``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import re
import sys
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvstore.errors import InvalidArgument, LimitExceeded

HugePages = Literal["auto", "on", "off"]
"""``auto``: ask where offered; ``on``: fail where not offered; ``off``: never ask."""

HUGE_PAGE_MODES: tuple[HugePages, ...] = ("auto", "on", "off")

SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
MOUNTS = "/proc/self/mounts"
SMAPS = "/proc/self/smaps"

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux 5.14+: fault in every page writable in one call (Python 3.11 lacks the constant)."""
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
"""Linux 5.14+ (Python 3.11 lacks the constant)."""
_HUGE_MOUNT_MODES = ("always", "within_size", "advise")
_VMA = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")
_HUGE_FIELDS = ("ShmemPmdMapped:", "FilePmdMapped:", "AnonHugePages:")


@dataclass(frozen=True, slots=True)
class HugePageSupport:
    """Whether pool files in one directory can get huge pages, and why (not)."""

    possible: bool
    """True when the kernel would back a madvised mapping there with huge pages."""
    reason: str
    """One line for the log and for errors."""


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _selected(text: str) -> str:
    """The ``[bracketed]`` word of a sysfs choice file."""
    found = re.search(r"\[([a-z_]+)\]", text)
    return found.group(1) if found else text.strip()


def _mount_of(directory: str, mounts: str) -> tuple[str, str, str] | None:
    """(mount point, fs type, options) of the mount holding ``directory``."""
    path = os.path.realpath(directory)
    best: tuple[str, str, str] | None = None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        point = parts[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, parts[2], parts[3])  # later mounts over the same point win
    return best


def file_system(directory: str, *, mounts: str = MOUNTS) -> str | None:
    """The type of the file system holding ``directory`` (``tmpfs``, ``ext4``...), None if unknown.

    Args:
        directory: a folder.
        mounts: the mount table (tests pass another).
    """
    mount = _mount_of(directory, _read(mounts) or "")
    return mount[1] if mount is not None else None


def support(
    directory: str, *, shmem_enabled: str = SHMEM_ENABLED, mounts: str = MOUNTS
) -> HugePageSupport:
    """Whether a pool file in ``directory`` can be backed by huge pages here.

    Args:
        directory: where the pool files are (``shm_dir``).
        shmem_enabled: the sysfs policy file (tests pass another).
        mounts: the mount table (tests pass another).
    """
    if sys.platform != "linux":
        return HugePageSupport(False, "transparent huge pages are Linux only")
    policy_text = _read(shmem_enabled)
    if policy_text is None:
        return HugePageSupport(False, "the kernel has no transparent huge pages for shmem")
    policy = _selected(policy_text)
    if policy == "deny":
        return HugePageSupport(False, "shmem_enabled is [deny]")
    mount = _mount_of(directory, _read(mounts) or "")
    if mount is None or mount[1] != "tmpfs":
        fs = mount[1] if mount else "an unknown file system"
        return HugePageSupport(False, f"{directory} is on {fs}, not tmpfs")
    if policy == "force":
        return HugePageSupport(True, "shmem_enabled is [force]")
    options = dict(o.partition("=")[::2] for o in mount[2].split(","))
    huge = options.get("huge", "never")
    if huge in _HUGE_MOUNT_MODES:
        return HugePageSupport(True, f"{mount[0]} is mounted huge={huge}")
    return HugePageSupport(
        False,
        f"{mount[0]} is mounted huge={huge} (shmem_enabled [{policy}] applies to memfd/SysV "
        "shm only): mount a tmpfs with huge=within_size and point shm_dir at it",
    )


def wanted(mode: str, directory: str) -> bool:
    """Whether to madvise a new pool's mappings in ``directory`` (``mode``: a `HugePages`).

    Raises:
        InvalidArgument: an unknown mode, or ``on`` where huge pages are not offered.
    """
    if mode not in HUGE_PAGE_MODES:
        raise InvalidArgument(f"huge_pages must be auto, on or off, got {mode!r}")
    if mode == "off":
        return False
    offer = support(directory)
    if mode == "on" and not offer.possible:
        raise InvalidArgument(f"no huge pages for pools: {offer.reason}")
    return offer.possible


def advise(mapped: mmap.mmap) -> bool:
    """``madvise(MADV_HUGEPAGE)`` a mapping before its pages are faulted in; False if refused."""
    try:
        mapped.madvise(_MADV_HUGEPAGE)
    except (OSError, ValueError):  # EINVAL: a kernel built without THP
        return False
    return True


def populate_read(mapped: mmap.mmap) -> None:
    """Map a runner's pages now (what ``MAP_POPULATE`` did), after `advise`."""
    try:
        mapped.madvise(_MADV_POPULATE_READ)
    except OSError:  # kernel older than 5.14
        with contextlib.suppress(OSError):
            mapped.madvise(mmap.MADV_WILLNEED)


def mapping_address(mapped: mmap.mmap) -> int:
    """Virtual address of a writable mapping's first byte."""
    anchor = ctypes.c_char.from_buffer(mapped)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # drop the export at once: it would keep `mmap.close` from closing


def mapped_huge_bytes(mapped: mmap.mmap, *, smaps: str = SMAPS) -> int | None:
    """Bytes of ``mapped`` the kernel maps with huge pages now; None if it cannot tell."""
    start = mapping_address(mapped)
    return huge_bytes_in_range(start, start + len(mapped), smaps=smaps)


def huge_bytes_in_range(start: int, end: int, *, smaps: str = SMAPS) -> int | None:
    """Huge-page bytes of the mappings overlapping ``[start, end)`` per ``smaps``."""
    text = _read(smaps)
    if text is None:
        return None
    total, found, inside = 0, False, False
    for line in text.splitlines():
        vma = _VMA.match(line)
        if vma is not None:
            inside = int(vma.group(1), 16) < end and int(vma.group(2), 16) > start
            found = found or inside
        elif inside and line.startswith(_HUGE_FIELDS):
            total += int(line.split()[1]) * 1024  # "ShmemPmdMapped:   65536 kB"
    return total if found else None


def populate(mapped: mmap.mmap, *, write: bool) -> None:
    """Fault a mapping's pages in now: writable (the server) or as a hint (runners).

    Raises:
        LimitExceeded: the kernel could not allocate the pages (a full tmpfs
            where nothing was reserved before: huge page pools).
    """
    if write:
        if sys.platform == "linux":
            try:
                mapped.madvise(_MADV_POPULATE_WRITE)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EFAULT/ENOMEM: no memory; touching would SIGBUS
                    raise LimitExceeded(
                        f"cannot fault in a {len(mapped)}-byte arena ({exc.strerror}): the "
                        "shared-memory filesystem is full (raise its size or lower the pool size)"
                    ) from exc
                # EINVAL: a kernel older than 5.14: touch the pages instead
        pages = np.frombuffer(mapped, dtype=np.uint8)
        try:
            pages[:: mmap.PAGESIZE] = 0  # the file is new: its bytes are zero already
        finally:
            del pages
    elif hasattr(mmap, "MADV_WILLNEED"):
        with contextlib.suppress(OSError):  # only a hint
            mapped.madvise(mmap.MADV_WILLNEED)


def reserve(fd: int, path: str, size: int) -> None:
    """Allocate the pages of a file now so that a full tmpfs fails here, loudly."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise LimitExceeded(
                f"no room for a {size}-byte arena in {os.path.dirname(path)}: "
                "the shared-memory filesystem is full (raise its size or lower the pool size)"
            ) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
