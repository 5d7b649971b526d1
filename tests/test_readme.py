"""The README's runner example runs as written against a live node."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from subprocess import PIPE

import pytest

from service.config import Config
from service.server import Server
from tests.inproc import ManualClock

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_example() -> str:
    text = README.read_text()
    match = re.search(r"## A runner in 20 lines\n\n```python\n(.*?)```", text, re.DOTALL)
    assert match, "the README lost its runner example"
    return match.group(1)


@pytest.fixture
async def node(server_config: Config, clock: ManualClock) -> AsyncIterator[Server]:
    # The example's blocks are 32 KiB: give it room beyond the tiny test default.
    config = dataclasses.replace(
        server_config,
        capacity_bytes=16 << 20,
        namespace_capacity_bytes=4 << 20,
        arena_bytes=1 << 20,
    )
    server = Server(config, clock=clock)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0.1)


def test_example_is_at_most_20_lines() -> None:
    code = [line for line in readme_example().splitlines() if line.strip()]
    assert len(code) <= 20


async def test_readme_example_runs_against_a_node(node: Server, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    env = {**os.environ, "KVSTORE_TARGET": node.address}
    # The node runs on this test's event loop: wait for the script without blocking it.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), env=env, stdout=PIPE, stderr=PIPE
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, stderr.decode()
    assert stdout.decode().splitlines() == [
        "cached tokens: 0",
        "stored blocks: 4",
        "reused tokens: 64 block 1 K: 1.0",
    ]
