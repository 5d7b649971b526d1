"""Start-up checks of every path setting, before the node binds a port.

A node once started with ``--shm-dir /dev/shm/x`` (a folder that did not
exist), reported itself healthy and answered the first RegisterNamespace
with INTERNAL. Now each path setting is checked once, at start:

- ``shm_dir`` (host pools only; a CUDA node keeps no files there): a missing
  folder whose parent exists is created, owned by the node's user, mode
  0700 (0750 and the group with ``pool_file_group``: the runners of that
  group open the pool files in it); a folder that cannot be used (a missing
  parent, not a folder, not writable, writable by every user without the
  sticky bit, where another user could replace the pool files) is a
  `PathError`. A folder that is not on tmpfs or hugetlbfs is a warning: the
  pool files would be written back to a disk.
- ``tenants_file``, ``tls_cert``, ``tls_key``, ``tls_client_ca``,
  ``peer_tls_ca``: set means a readable regular file, else a `PathError`.
- ``disk_path`` (the disk tier, docs/disk.md): set means a regular file this
  user may read and write, or a missing file in a writable folder (never its
  parents: a typo stays an error). Whether the file system takes O_DIRECT and
  holds ``disk_capacity_bytes`` is found when the tier opens the file, still
  before a port is bound (`service.disk.node_tier`).

A `PathError` is an `OSError` whose message is one line naming the
setting, the path and the fix; ``kvstore-server`` prints it and exits 1.
"""

from __future__ import annotations

import logging
import os
import stat

from kvstore.pool import host_pages
from service.config import Config
from service.memory.budget import pool_group_id

log = logging.getLogger(__name__)

FILE_SETTINGS = ("tenants_file", "tls_cert", "tls_key", "tls_client_ca", "peer_tls_ca")
"""The settings that name a file the node reads at start."""

MEMORY_FILE_SYSTEMS = ("tmpfs", "hugetlbfs")
"""File systems whose files live in memory only (a pool file elsewhere goes to a disk)."""


class PathError(OSError):
    """A path setting names something the node cannot use (one line: setting, path, fix)."""


def check_paths(config: Config, *, mounts: str = host_pages.MOUNTS) -> list[str]:
    """Check (and where safe create) every path the node will use; returns warnings.

    The warnings are logged here too.

    Args:
        config: the node's configuration.
        mounts: path of the mount table (tests pass another).

    Raises:
        PathError: a path cannot be used; the message says how to fix it.
    """
    for name in FILE_SETTINGS:
        path = getattr(config, name)
        if path:
            _check_file(name, path)
    if config.disk_path:
        _check_disk_path(config.disk_path)
    warnings: list[str] = []
    if config.device == "cpu":
        warnings += _check_shm_dir(config, mounts)
    for warning in warnings:
        log.warning("%s", warning)
    return warnings


def _check_file(name: str, path: str) -> None:
    flag = "--" + name.replace("_", "-")
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise PathError(f"{name} {path}: no such file; fix the path or unset {flag}") from None
    except OSError as exc:
        raise PathError(f"{name} {path}: {exc.strerror}; fix the path or unset {flag}") from None
    if not stat.S_ISREG(info.st_mode):
        raise PathError(f"{name} {path}: not a regular file; point {flag} at the file")
    if not os.access(path, os.R_OK):
        raise PathError(
            f"{name} {path}: not readable by this user (uid {os.getuid()}); "
            f"give it read access (chmod/chown) or point {flag} elsewhere"
        )


def _check_disk_path(path: str) -> None:
    fix = "fix the path or unset --disk-path (memory only)"
    if os.path.isdir(path):
        raise PathError(f"disk_path {path}: a folder; name a file in it ({path}/kvstore.disk)")
    if os.path.lexists(path):
        if not os.path.isfile(path):
            raise PathError(f"disk_path {path}: not a regular file; {fix}")
        if not os.access(path, os.R_OK | os.W_OK):
            raise PathError(
                f"disk_path {path}: not readable and writable by this user (uid {os.getuid()}); "
                f"chown it to this user or {fix}"
            )
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise PathError(
            f"disk_path {path}: no such folder {parent}; create it (mkdir -p {parent}) or {fix}"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PathError(
            f"disk_path {path}: cannot create the file, {parent} is not writable by this user "
            f"(uid {os.getuid()}); chown it to this user or {fix}"
        )


def _check_shm_dir(config: Config, mounts: str) -> list[str]:
    path = config.shm_dir
    where = "choose another --shm-dir"
    if not os.path.lexists(path):
        _create(config, path, where)
    if not os.path.isdir(path):
        raise PathError(f"shm_dir {path}: not a folder; {where}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PathError(
            f"shm_dir {path}: not writable by this user (uid {os.getuid()}); "
            f"chown it to this user or {where}"
        )
    mode = os.stat(path).st_mode
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise PathError(
            f"shm_dir {path}: writable by every user without the sticky bit (another user "
            f"could replace the pool files); chmod o-w or +t it, or {where}"
        )
    fs = host_pages.file_system(path, mounts=mounts)
    if fs not in MEMORY_FILE_SYSTEMS:
        return [
            f"shm_dir {path} is on {fs or 'an unknown file system'}, not tmpfs or hugetlbfs: "
            "the pool files may be written back to a disk (slower, and the KV bytes reach it); "
            "point --shm-dir at a tmpfs such as /dev/shm"
        ]
    return []


def _create(config: Config, path: str, where: str) -> None:
    """Create the missing last folder of ``path`` (never its parents: a typo stays an error)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise PathError(
            f"shm_dir {path}: no such folder, nor its parent {parent}; "
            f"create it (mkdir -p {path}) or {where}"
        )
    group = pool_group_id(config.pool_file_group)
    mode = 0o700 if group is None else 0o750
    try:
        os.mkdir(path, mode)
        if group is not None:
            os.chown(path, -1, group)
        os.chmod(path, mode)  # mkdir's mode is masked by the umask
    except FileExistsError:
        return  # made meanwhile (another node); checked as any existing folder
    except OSError as exc:
        raise PathError(
            f"shm_dir {path}: no such folder, and it cannot be created ({exc.strerror}); "
            f"create it (mkdir -p {path}) or {where}"
        ) from None
    log.info("created shm_dir %s (mode %o)", path, mode)
