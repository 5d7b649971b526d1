"""A runner that cannot map a host pool is told why and what fixes it (pool/host_access.py).

The compose case (a container with its own /dev/shm) is modelled end to end,
with real mount namespaces, in tests/e2e/test_compose.py; these tests check
each message on plain directories, and the user/group rule with a child that
drops root.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.pool import HostPool, PoolDescriptor, PoolUnavailable, attach
from kvstore.types import NamespaceId, SlotId
from tests.kvstore.pool.conftest import LAYOUT, NS

ROOT = Path(__file__).resolve().parents[3]


def elsewhere(descriptor: PoolDescriptor, directory: Path) -> PoolDescriptor:
    """The same descriptor as a runner that has another ``directory`` at that path would see it."""
    arenas = tuple(
        dataclasses.replace(a, path=str(directory / os.path.basename(a.path)))
        for a in descriptor.arenas
    )
    return dataclasses.replace(descriptor, arenas=arenas)


def test_runner_without_the_pool_directory_is_told_to_share_it(
    pool: HostPool, tmp_path: Path
) -> None:
    missing = tmp_path / "not-mounted"
    with pytest.raises(PoolUnavailable) as info:
        attach(elsewhere(pool.descriptor, missing))
    message = str(info.value)
    assert f"pool directory {missing} does not exist in this process" in message
    assert "does not share the node's pool directory" in message
    assert "mount one tmpfs volume" in message


def test_runner_with_its_own_empty_shm_is_told_it_does_not_share_the_nodes(
    pool: HostPool, tmp_path: Path
) -> None:
    private = tmp_path / "private-shm"  # a container's own /dev/shm: there, but empty
    private.mkdir()
    (private / "unrelated-file").write_bytes(b"x")
    with pytest.raises(PoolUnavailable) as info:
        attach(elsewhere(pool.descriptor, private))
    message = str(info.value)
    assert f"pool file {private}/" in message and "is not visible to this process" in message
    assert f"does not share the node's {private}" in message
    assert "docs/pools.md" in message


def test_node_restarted_says_so(pool_dir: Path) -> None:
    old = HostPool.create(NS, LAYOUT.block_bytes, 2, 0xABC, directory=str(pool_dir))
    old.close()
    new = HostPool.create(NS, LAYOUT.block_bytes, 2, 0xDEF, directory=str(pool_dir))
    try:
        with pytest.raises(PoolUnavailable, match=r"the node restarted.*attach the pool again"):
            attach(old.descriptor)
    finally:
        new.close()


def test_dropped_namespace_says_so(pool: HostPool, pool_dir: Path) -> None:
    other = HostPool.create(
        NamespaceId("ffeeddccbbaa9988"), LAYOUT.block_bytes, 2, 0xABC, directory=str(pool_dir)
    )
    other.close()  # same node (epoch 0xABC), this namespace dropped
    with pytest.raises(PoolUnavailable, match=r"dropped namespace ffeeddccbbaa9988"):
        attach(other.descriptor)


# --- users and groups: a child that imports as root, then drops to another uid ------------

CHILD = """
import json, os, sys
from kvstore.pool import attach, PoolDescriptor, ArenaSpec
from kvstore.errors import PermissionDenied
d = json.loads(sys.argv[1])
descriptor = PoolDescriptor(
    "host", d["epoch"], d["namespace"], d["block_bytes"], d["capacity"], d["slots_per_arena"],
    tuple(ArenaSpec(a["index"], a["size_bytes"], a["path"]) for a in d["arenas"]),
)
os.setgroups(d["groups"])
os.setgid(d["gid"])
os.setuid(d["uid"])
try:
    mapping = attach(descriptor)
except PermissionDenied as exc:
    print("denied:", exc)
    sys.exit(3)
mapping.buffer(0)[:4] = b"ok!!"
print("mapped")
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another uid can traverse (pytest's tmp_path is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="kvstore-access-", dir="/dev/shm"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_as(uid: int, gid: int, groups: list[int], descriptor: PoolDescriptor) -> tuple[int, str]:
    d = {
        "epoch": descriptor.epoch,
        "namespace": descriptor.namespace,
        "block_bytes": descriptor.block_bytes,
        "capacity": descriptor.capacity,
        "slots_per_arena": descriptor.slots_per_arena,
        "arenas": [
            {"index": a.index, "size_bytes": a.size_bytes, "path": a.path}
            for a in descriptor.arenas
        ],
        "uid": uid,
        "gid": gid,
        "groups": groups,
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(d)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="switching users needs root"
)


@needs_root
def test_runner_of_another_uid_is_told_owner_mode_and_the_setting(shared_dir: Path) -> None:
    pool = HostPool.create(NS, LAYOUT.block_bytes, 2, 0xABC, directory=str(shared_dir))
    try:
        code, out = run_as(65534, 65534, [], pool.descriptor)
    finally:
        pool.close()
    assert code == 3, out
    assert "(uid 0, gid 0, mode 0600) as uid 65534" in out
    assert "KVSTORE_POOL_FILE_GROUP" in out


@needs_root
def test_runner_in_the_pool_file_group_maps_the_pool(shared_dir: Path) -> None:
    group = 4242  # the node's pool_file_group: files 0660, runner in that group
    pool = HostPool.create(
        NS, LAYOUT.block_bytes, 2, 0xABC, directory=str(shared_dir), mode=0o660, group=group
    )
    try:
        code, out = run_as(65534, 65534, [group], pool.descriptor)
        assert code == 0, out
        assert bytes(pool.view(SlotId(0))[:4]) == b"ok!!"  # written through the runner's mapping
    finally:
        pool.close()
