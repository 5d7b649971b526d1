"""torch is optional: the node, the SDK (numpy views) and the CLI work without it.

`scripts/check_light_install.sh` proves it on a real ``pip install .`` in a
fresh venv (CI runs it); these tests catch a regression in seconds: the
package metadata keeps torch out of the dependencies, and a process in which
``import torch`` fails runs a node, stores and reads blocks through numpy
views, runs the CLI, and is told which extra a torch view needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WITHOUT_TORCH = r"""
import sys
sys.modules["torch"] = None  # `import torch` raises ImportError from here on

import asyncio, threading
import numpy as np
from kvstore import KVLayout
from kvstore.cli import app
from kvstore.client import SyncClient
from kvstore.extras import MissingExtra
from service.config import Config
from service.server import Server

config = Config(port=0, metrics_port=0, shm_dir=sys.argv[1], capacity_bytes=4 << 20,
                namespace_capacity_bytes=1 << 20, arena_bytes=1 << 20, pool_prefault=False)
server = Server(config)
loop = asyncio.new_event_loop()
started, stop = threading.Event(), asyncio.Event()

async def run():
    await server.start()
    started.set()
    await stop.wait()
    await server.stop(0.1)

thread = threading.Thread(target=loop.run_until_complete, args=(run(),))
thread.start()
assert started.wait(30), "node did not start"
try:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
    tokens = list(range(12))
    with SyncClient(server.address, tenant="light") as kv:
        ns = kv.register_namespace("light-model", layout)
        blocks = [np.full(layout.block_shape, i + 1, np.uint16) for i in range(3)]
        assert kv.store(ns, tokens, blocks).committed == 3
        hit = kv.lookup(ns, tokens, pin=True)
        print("numpy", [int(v.flat[0]) for v in hit.numpy_views()])
        try:
            hit.torch_views()
        except MissingExtra as exc:
            print("torch views:", exc)
        kv.release(hit)
    app(["status", "--target", server.address, "--json"], standalone_mode=False)
finally:
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)
assert "torch" not in {m for m, v in sys.modules.items() if v is not None}
"""


def test_torch_is_an_extra_not_a_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [
        dep.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()
        for dep in project["dependencies"]
    ]
    assert "torch" not in names and "numpy" in names
    extras = project["optional-dependencies"]
    for extra in ("torch", "cuda", "hf", "dev"):
        assert any(d.startswith("torch") for d in extras[extra]), f"[{extra}] needs torch"
    assert any(d.startswith("cupy") for d in extras["cuda"])
    assert any(d.startswith("transformers") for d in extras["hf"])
    assert "vllm" in extras


def test_node_sdk_and_cli_work_where_torch_cannot_be_imported(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "numpy [1, 2, 3]" in lines
    (torch_line,) = [line for line in lines if line.startswith("torch views:")]
    assert "pip install 'kvstore[torch]'" in torch_line
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_line
    status = json.loads(done.stdout[done.stdout.index("{") : done.stdout.rindex("}") + 1])
    assert status["used_blocks"] == 3
