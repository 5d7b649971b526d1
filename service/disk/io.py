"""The tier file: opened with O_DIRECT, preallocated once, positional I/O.

`TierFile` is the seam between the tier and the kernel: tests swap it for a
subclass that fails writes (ENOSPC, EIO) without a full file system.
Buffers handed to it must be page-aligned with lengths in whole pages when
the file is direct (`aligned` makes such buffers: anonymous ``mmap``\\ s).

Start-up errors are `DiskTierError`\\ s: one line naming the setting
(``disk_path``, ``disk_capacity_bytes``, ``disk_direct_io``), the path and
the fix, as `service.paths` does for the other path settings.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Any

from service.disk.format import PAGE, VERSION, Superblock, data_bytes, file_bytes_for


class DiskTierError(OSError):
    """The tier cannot start: one line naming the setting, the path and the fix."""


def aligned(nbytes: int) -> mmap.mmap:
    """A zeroed, page-aligned buffer of ``nbytes`` (rounded up to whole pages)."""
    return mmap.mmap(-1, max(PAGE, -(-nbytes // PAGE) * PAGE))


def address_of(buf: Any) -> int:
    """The address of a writable buffer's first byte (to tell whether it is aligned)."""
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (best effort, for messages)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                inside = path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")
                if len(parts) > 2 and inside and len(parts[1]) >= len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


class TierFile:
    """One open tier file. Methods may run on any thread (the kernel orders them)."""

    def __init__(self, fd: int, size: int, direct: bool) -> None:
        self.fd = fd
        self.size = size
        self.direct = direct

    def read_into(self, buffers: list[Any], offset: int) -> int:
        """``preadv``: fill the buffers from ``offset``; the byte count read."""
        return os.preadv(self.fd, buffers, offset)

    def write(self, buffers: list[Any], offset: int) -> None:
        """``pwritev`` all of the buffers at ``offset`` (a short write is an EIO)."""
        want = sum(len(memoryview(b)) for b in buffers)
        done = os.pwritev(self.fd, buffers, offset)
        if done != want:
            raise OSError(errno.EIO, f"short write: {done} of {want} bytes at {offset}")

    def zero_page(self, offset: int, page: Any) -> None:
        """Write one zero page (a header invalidated) at ``offset``."""
        self.write([page], offset)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_tier_file(
    path: str, capacity_bytes: int, direct: bool, region_bytes: int
) -> tuple[TierFile, Superblock, bool]:
    """Open or create the tier file, sized to fit ``capacity_bytes``.

    Returns the file, its superblock (its own region size when reopened) and
    whether it was reopened (False: a new file, nothing to rebuild).

    Raises:
        DiskTierError: a path or a size the tier cannot use; one line.
    """
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise DiskTierError(
            f"disk_path {path}: the folder {folder} does not exist; "
            "create it (on a local SSD) or set another disk_path"
        )
    if os.path.isdir(path):
        raise DiskTierError(
            f"disk_path {path} is a folder; name a file in it, e.g. {path.rstrip('/')}/kvstore.disk"
        )
    if region_bytes % PAGE or region_bytes < 2 * PAGE:
        raise ValueError(
            f"region_bytes {region_bytes} must be a multiple of {PAGE}, at least {2 * PAGE}"
        )
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    existed = os.path.exists(path)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL and direct:
            raise DiskTierError(
                f"disk_path {path}: its file system ({_fs_type(folder)}) "
                "does not support O_DIRECT; "
                "put the tier on a local SSD (ext4, xfs) or set disk_direct_io = false"
            ) from None
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise DiskTierError(
                f"disk_path {path}: cannot be written ({e.strerror}); "
                "give the node's user write access to it and its folder, or set another disk_path"
            ) from None
        raise DiskTierError(
            f"disk_path {path}: cannot be opened ({e.strerror}); set another disk_path"
        ) from None
    try:
        return _prepare(fd, path, capacity_bytes, direct, region_bytes, existed)
    except BaseException:
        os.close(fd)
        if not existed:
            os.unlink(path)
        raise


def _prepare(
    fd: int, path: str, capacity_bytes: int, direct: bool, region_bytes: int, existed: bool
) -> tuple[TierFile, Superblock, bool]:
    size = os.fstat(fd).st_size
    old: Superblock | None = None
    if size:
        page = aligned(PAGE)
        os.preadv(fd, [page], 0)
        old = Superblock.parse(page)
        version = Superblock.version_of(page)
        if old is None and version is not None:
            raise DiskTierError(
                f"disk_path {path} is a version {version} disk tier file, this node "
                f"reads version {VERSION}; remove it (its blocks are lost) or set another disk_path"
            )
        if old is None:
            raise DiskTierError(
                f"disk_path {path} exists and is not a kvstore disk tier file; "
                "remove it or set another disk_path"
            )
        region_bytes = old.region_bytes
    regions, file_bytes = data_bytes(capacity_bytes, region_bytes)
    if regions < 1:
        raise DiskTierError(
            f"disk_capacity_bytes {capacity_bytes} is too small for one "
            f"{region_bytes >> 20} MiB region; "
            f"set it to at least {file_bytes_for(1, region_bytes)} bytes"
        )
    if file_bytes > size:
        vfs = os.statvfs(path)
        free = vfs.f_bavail * vfs.f_frsize
        if vfs.f_blocks and file_bytes - size > free:  # ramfs counts no blocks: unknown
            raise DiskTierError(
                f"disk_capacity_bytes {capacity_bytes} is more than the {free} bytes free "
                f"at disk_path {path}; "
                "lower it or free space"
            )
        try:
            os.posix_fallocate(fd, 0, file_bytes)
        except OSError as e:
            raise DiskTierError(
                f"disk_path {path}: preallocating {file_bytes} bytes failed ({e.strerror}); "
                "lower disk_capacity_bytes or free space"
            ) from None
    elif file_bytes < size:
        os.ftruncate(fd, file_bytes)  # a smaller cap: the regions past it are gone
    # A resized file moved its checkpoint area (after the last region): scan instead.
    clean = old.clean if old is not None and old.regions == regions else 0
    sb = Superblock(region_bytes, regions, clean)
    if sb != old:
        page = aligned(PAGE)
        page.write(sb.pack())
        os.pwritev(fd, [page], 0)
        os.fsync(fd)
    return TierFile(fd, file_bytes, direct), sb, old is not None
