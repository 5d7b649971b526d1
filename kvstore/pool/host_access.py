"""Why a runner cannot map a host pool's files, in words that say what to do.

A missing arena file has three causes that need three different fixes: the
runner does not see the node's directory at all (a container with its own
``/dev/shm``, the usual one in docker-compose), the node restarted, or the
node dropped the namespace. A file the runner may not open needs another
user or group. `host.HostMapping.open` raises what these functions build.
"""

from __future__ import annotations

import errno
import os
import stat

from kvstore.errors import PermissionDenied
from kvstore.pool.base import PoolDescriptor, PoolUnavailable

SHARING_HINT = (
    "the node and every runner must see the same files at the same path: on one host, "
    "run them on one filesystem; in containers (each has its own /dev/shm), mount one "
    "tmpfs volume at the node's shm_dir in the node and in every runner "
    "(docker-compose.yml; docs/pools.md, 'Runners in containers')"
)
"""What to do when a runner does not see the node's pool files."""


def missing_file_error(path: str, descriptor: PoolDescriptor) -> PoolUnavailable:
    """Say why an arena file is not there: not shared, the node restarted, or the pool was dropped.

    The runner asked the node for this descriptor moments ago, so a missing
    file most often means the runner looks at *another* directory of the same
    name (a container's private /dev/shm). What the directory does hold tells
    the cases apart: nothing of the node (not shared, or the node stopped),
    files of another epoch (the node restarted), or other files of this epoch
    (this namespace's pool was dropped).
    """
    directory, name = os.path.split(path)
    # name = {prefix}-{pid}-{epoch:x}-{namespace}-{index}; the prefix may hold dashes.
    tail = f"-{descriptor.epoch:x}-{descriptor.namespace}-"
    creator = name.split(tail, 1)[0] if tail in name else ""
    prefix = creator.rsplit("-", 1)[0] if "-" in creator else ""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return PoolUnavailable(
            f"pool directory {directory} does not exist in this process, so pool file {name} "
            f"cannot be mapped: this runner does not share the node's pool directory; "
            f"{SHARING_HINT}"
        )
    except OSError:
        names = []
    epoch = f"-{descriptor.epoch:x}-"
    if any(epoch in other for other in names):
        return PoolUnavailable(
            f"pool file {path} is gone: the node dropped namespace {descriptor.namespace} "
            f"since epoch {descriptor.epoch:x}; attach the pool again"
        )
    if prefix and any(other.startswith(f"{prefix}-") for other in names):
        return PoolUnavailable(
            f"pool file {path} is gone: the node restarted (its pool files in {directory} "
            f"have another epoch than {descriptor.epoch:x}); attach the pool again"
        )
    return PoolUnavailable(
        f"pool file {path} is not visible to this process: {directory} here holds no pool "
        f"file of the node, so this runner most likely does not share the node's "
        f"{directory} (or the node stopped: then attach the pool again once it is back); "
        f"{SHARING_HINT}"
    )


def permission_error(path: str) -> PermissionDenied:
    """Name the file's owner, group and mode, this process's ids, and the setting that fixes it."""
    try:
        info = os.stat(path)
        owner = f" (uid {info.st_uid}, gid {info.st_gid}, mode {stat.S_IMODE(info.st_mode):04o})"
    except OSError:
        owner = ""
    groups = sorted({os.getegid(), *os.getgroups()})
    return PermissionDenied(
        f"cannot open pool file {path}{owner} as uid {os.geteuid()} (groups "
        f"{', '.join(map(str, groups))}): run the runner as the node's user, or set the "
        "node's pool_file_group (KVSTORE_POOL_FILE_GROUP) to a group the runner is in, "
        "which makes the files mode 0660 (docs/pools.md, 'Runners in containers')"
    )


def open_shared(path: str, flags: int, what: str, descriptor: PoolDescriptor) -> int:
    """Open a file of a node's pool for a runner (``what``: "pool file", "stamp file").

    Raises:
        PoolUnavailable: the file is gone (the node restarted or dropped the pool) or
            is a symbolic link.
        PermissionDenied: the runner may not read it (`permission_error`).
    """
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError as exc:
        raise missing_file_error(path, descriptor) from exc
    except PermissionError as exc:
        raise permission_error(path) from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PoolUnavailable(f"{what} {path} is a symbolic link; refusing") from exc
        raise
