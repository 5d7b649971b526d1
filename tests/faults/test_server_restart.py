"""The node is SIGKILLed and restarted on the same port while runners keep going.

Runners (the client SDK in their own processes) see the node vanish, get
errors rather than hangs, reconnect when it is back, notice the new pool
epoch, drop their mappings and map the new pools. No runner ever reads bytes
other than those of the block it asked for, and what the restarted node
serves was stored after the restart (it starts empty). The killed node's
pool files are removed by the next node started on the same directory.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks._server import ServerProcess
from kvstore.v1 import kvstore_pb2 as pb
from tests.e2e.processes import LiveRunner, node_stats, wait_for_stats
from tests.e2e.workload import BLOCK_SIZE, system_prompt, user_prompt
from tests.redis.server import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

TTL = 2.0


class RestartableNode:
    """A node process on a fixed port and pool prefix, which the test kills and restarts."""

    def __init__(self, shm: Path) -> None:
        self.shm = shm
        self.port = free_port()
        self.prefix = f"kvfault{int(time.time() * 1000) % 10**8}"
        self.server: ServerProcess | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        server = ServerProcess.start(
            self.shm,
            capacity="64MiB",
            extra_args=("--port", str(self.port), "--pool-prefix", self.prefix),
        )
        server.pool_prefix = self.prefix  # the flag above overrides ServerProcess's own
        assert server.target == self.target
        self.server = server
        return server

    def kill(self) -> None:
        assert self.server is not None
        self.server.process.kill()
        assert self.server.stop() == -9
        self.server = None

    def pool_files(self) -> list[Path]:
        return sorted(self.shm.glob(self.prefix + "-*"))


@pytest.fixture
def node() -> Iterator[RestartableNode]:
    with tempfile.TemporaryDirectory(prefix="kvstore-fault-") as shm:
        node = RestartableNode(Path(shm))
        try:
            yield node
        finally:
            if node.server is not None:
                status = node.server.stop()
                tail = node.server.log_tail()
                assert status == 0, tail
                assert node.pool_files() == [], "pool files left after a clean shutdown"


def result(session: LiveRunner, op: dict, timeout: float = 30.0) -> dict:
    session.send(json.dumps(op))
    return session.wait_event("result", timeout)


def until_served(session: LiveRunner, op: dict, timeout: float = 15.0) -> dict:
    """Repeat ``op`` until the node answers it: until the channel has reconnected (its
    backoff), a call that is not idempotent fails fast with ``UNAVAILABLE``, as it should."""

    def answered(doc: dict) -> bool:
        assert doc.get("error") in {None, "ServerUnavailable", "DeadlineExceeded"}, doc
        return doc.get("error") is None

    return wait_until(
        lambda: result(session, op),
        ok=answered,
        within=timeout,
        interval=0.1,
        what=f"{op['op']} to be served after the restart",
    )


def lookups(stats: pb.StatsResponse) -> int:
    """Lookups the node answered, over every namespace and tenant."""
    return sum(tenant.lookups for ns in stats.namespaces for tenant in ns.tenants)


def test_runners_survive_a_node_sigkill_and_remap_after_its_restart(
    node: RestartableNode, live_runners: Callable[..., LiveRunner]
) -> None:
    first = node.start()
    prompt = system_prompt("restart") + user_prompt("restart", 56)  # 8 full blocks
    blocks = len(prompt) // BLOCK_SIZE
    session = live_runners(node.target, "session", lease_ttl=TTL)
    workers = [
        live_runners(
            node.target, "worker", "--seed", str(seed), "--duration", "8", "--tolerate-outage",
            lease_ttl=TTL, timeout=2.0,
        )
        for seed in (1, 2)
    ]  # fmt: skip

    stored = result(session, {"op": "store", "tokens": prompt})
    assert stored.get("error") is None and stored["committed"] == blocks
    before = result(session, {"op": "lookup", "tokens": prompt})
    assert (before["hit_blocks"], before["mismatches"]) == (blocks, 0)
    old_epoch = before["epoch"]
    assert before["mapping_epoch"] == old_epoch == node_stats(node.target).pool_epoch
    old_files = node.pool_files()
    assert old_files, "the node made no pool files"

    # The workers run against the first node: each holds a lease there and looks up.
    served = lookups(node_stats(node.target))
    wait_for_stats(
        node.target,
        lambda s: s.leases >= 1 + len(workers) and lookups(s) >= served + 2 * len(workers),
        timeout=10.0,
        what="both workers at work on the first node",
    )
    node.kill()
    assert node.pool_files() == old_files  # SIGKILL: nobody unlinked them
    down = result(session, {"op": "lookup", "tokens": prompt})
    assert down["error"] in {"ServerUnavailable", "DeadlineExceeded"}, down
    for worker in workers:  # the workers meet the outage too
        worker.wait_event("outage", timeout=10.0)

    second = node.start()
    assert second.process.pid != first.process.pid
    left = set(old_files) & set(node.pool_files())
    assert not left, f"stale pool files of the killed node survived the restart: {left}"
    new_epoch = node_stats(node.target).pool_epoch
    assert new_epoch != old_epoch

    # The same runner, same client: the node is back empty, so the prompt
    # misses; nothing is read through the old mapping.
    after = until_served(session, {"op": "lookup", "tokens": prompt})
    assert after["epoch"] == after["mapping_epoch"] == new_epoch
    assert after["hit_blocks"] == 0
    assert after["lease_lost"] >= 1  # the old lease died with the node
    restored = result(session, {"op": "store", "tokens": prompt})
    assert restored["committed"] == blocks
    again = result(session, {"op": "lookup", "tokens": prompt})
    assert (again["hit_blocks"], again["mismatches"], again["wrong_hash"]) == (blocks, 0, 0)
    assert again["mapping_epoch"] == new_epoch

    for worker in workers:
        assert worker.wait(30) == 0, worker.stderr
        [counts] = worker.json_lines()
        print("worker across the restart:", counts)
        assert counts["mismatches"] == counts["wrong_hash"] == 0, counts
        assert counts["errors"] >= 1, counts  # it met the outage ...
        assert counts["epochs"] == 2, counts  # ... and worked on both nodes
        assert counts["verified"] > 0, counts
    session.send("")
    assert session.wait(30) == 0, session.stderr
    stats = wait_for_stats(
        node.target,
        lambda s: (s.leases, s.pinned, s.writing) == (0, 0, 0),
        timeout=10.0,
        what="the runners' leases to close",
    )
    [ns] = stats.namespaces
    assert ns.free + ns.ready == ns.capacity
