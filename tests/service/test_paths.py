"""Every path setting is checked at start (`service.paths`): a missing shm_dir is
created where that is safe, anything unusable stops the node with one line naming
the setting, the path and the fix (exit 1), a disk-backed shm_dir is a warning.

A node once started with a missing ``--shm-dir``, reported healthy and answered
the first RegisterNamespace with INTERNAL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import stat
import sys

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from service.paths import PathError, check_paths
from service.server import Server

LAYOUT = pb.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float16")
MOUNTS_TMPFS = "tmpfs / tmpfs rw,nosuid 0 0\n"
MOUNTS_EXT4 = "/dev/vda / ext4 rw,relatime 0 0\n"


async def test_a_missing_shm_dir_is_created_and_serves(server_config, tmp_path):
    shm = tmp_path / "x"
    server = Server(dataclasses.replace(server_config, shm_dir=str(shm)))
    await server.start()
    try:
        assert stat.S_IMODE(os.stat(shm).st_mode) == 0o700 and os.stat(shm).st_uid == os.getuid()
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            reg = await stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(model_id="m", layout=LAYOUT, capacity_bytes=1 << 16),
                timeout=10,
            )
            assert reg.namespace_id
    finally:
        await server.stop(0.1)


async def run_node(*args: str) -> tuple[int | None, str]:
    """`python -m service` with ``args``: (exit code, or None if it kept running; stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "service", "--port", "0", "--metrics-port", "0",
        "--pool-prefault", "false", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 20)
    except TimeoutError:
        proc.kill()
        _, err = await proc.communicate()
        return None, err.decode()
    return proc.returncode, err.decode()


async def test_an_unusable_path_stops_the_node_with_one_line(tmp_path):
    afile = tmp_path / "a-file"
    afile.write_text("")
    cases = {
        "missing parent": (
            ["--shm-dir", str(tmp_path / "no" / "x")],
            f"shm_dir {tmp_path / 'no' / 'x'}: no such folder, nor its parent",
            "mkdir -p",
        ),
        "not a folder": (["--shm-dir", str(afile)], f"shm_dir {afile}: not a folder", "--shm-dir"),
        "tenants file": (
            ["--shm-dir", str(tmp_path), "--tenants-file", str(tmp_path / "tenants.toml")],
            f"tenants_file {tmp_path / 'tenants.toml'}: no such file",
            "--tenants-file",
        ),
    }
    for name, (args, says, fix) in cases.items():
        code, err = await run_node(*args)
        assert code == 1, (name, code, err)
        lines = [line for line in err.splitlines() if line.startswith("kvstore-server:")]
        assert len(lines) == 1 and says in lines[0] and fix in lines[0], (name, err)
        assert "Traceback" not in err, (name, err)


def test_an_unsafe_or_disk_backed_shm_dir(server_config, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone could replace the pool files
    with pytest.raises(PathError, match="without the sticky bit"):
        check_paths(dataclasses.replace(server_config, shm_dir=str(shared)))
    os.chmod(shared, 0o1777)  # /dev/shm's mode: fine
    config = dataclasses.replace(server_config, shm_dir=str(shared))
    tmpfs, ext4 = tmp_path / "mounts-tmpfs", tmp_path / "mounts-ext4"
    tmpfs.write_text(MOUNTS_TMPFS)
    ext4.write_text(MOUNTS_EXT4)
    assert check_paths(config, mounts=str(tmpfs)) == []
    (warning,) = check_paths(config, mounts=str(ext4))
    assert warning.startswith(f"shm_dir {shared} is on ext4, not tmpfs or hugetlbfs")
    # A CUDA node keeps no pool files: its shm_dir is not used, so not checked.
    cuda = dataclasses.replace(server_config, device="cuda:0", shm_dir=str(tmp_path / "no" / "x"))
    assert check_paths(cuda) == []
    assert not (tmp_path / "no").exists()
