"""Helpers of the KV-event tests: a node that ingests a fake engine, and script subprocesses."""

from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import replace

from service.config.engines import EngineSource
from service.server import Server
from tests.redis.rpc import MODEL
from tests.vllm_events.fake_engine import FakeEngine, batch
from tests.waiting import until


async def start_node(
    server_config, engine: FakeEngine, *, name: str = "fake-0", **overrides
) -> Server:
    """A started node that ingests ``engine``'s events as its engine ``name``."""
    source = EngineSource(
        name=name,
        endpoint=engine.endpoint,
        replay_endpoint=engine.replay_endpoint,
        model_id=MODEL,
    )
    server = Server(replace(server_config, engine_kv_events=(source,), **overrides))
    await server.start()
    return server


async def join(engine: FakeEngine, state, seq: int) -> int:
    """Publish empty batches from ``seq`` on until the node has read one; the next seq."""
    while state.last_seq is None:
        engine.send(seq, batch([]))
        seq += 1
        try:
            await until(lambda: state.last_seq is not None, within=0.2)
        except AssertionError:
            continue
    return seq


async def read_line(proc: subprocess.Popen[str], deadline: float) -> str:
    """The next stdout line of ``proc`` (read on a thread); fails past ``deadline``."""
    assert proc.stdout is not None
    left = deadline - time.monotonic()
    if left <= 0:
        raise AssertionError("timed out waiting for the subprocess")
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), left)
    if not line:
        raise AssertionError(f"the subprocess ended (rc {proc.poll()}) before answering")
    return line.strip()


def stop(proc: subprocess.Popen[str]) -> None:
    """Close stdin (the scripts exit on EOF), then kill if it lingers."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=10)
    except (subprocess.TimeoutExpired, OSError):
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.stdout is not None:
            proc.stdout.close()
