"""A kvstore connector with faults a test switches on, for real vLLM engines.

The engine loads it like the real one (``kv_connector_module_path`` =
``tests.integrations.vllm.faulty``, ``kv_connector`` = ``FaultyConnector``);
every fault is off until the test creates its file in the folder named by
``KVSTORE_TEST_FAULTS`` in the engine's environment. Nothing of this lives
in the connector itself: production code has no test hooks.

- ``hold-loads``: each load waits before it starts (after touching
  ``hold-loads.reached``) while the file exists; ``hold-loads-rank-N`` holds
  rank N's loads only, and sends every load of the step to the load thread
  (a step that runs no forward copies in the step itself, where one held
  rank would hold the others' reports too: the case under test is one rank
  reporting while another still copies).
- ``leak-pins``: the scheduler side releases the pins of every load it sends
  (the bookkeeping bug of a connector that trusted one rank's report): only
  the workers' stamp checks stand between the engine and reused slots.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kvstore.integrations.vllm import KVStoreConnector
from kvstore.integrations.vllm.worker import WorkerSide
from tests.integrations.vllm.common import FAULTS_ENV

HOLD_LIMIT = 600.0


def fault_dir() -> Path | None:
    path = os.environ.get(FAULTS_ENV)
    return Path(path) if path else None


def _hold(rank: int) -> None:
    folder = fault_dir()
    if folder is None:
        return
    for name in ("hold-loads", f"hold-loads-rank-{rank}"):
        hold = folder / name
        if hold.exists():
            (folder / f"{name}.reached").touch()
            deadline = time.monotonic() + HOLD_LIMIT
            while hold.exists() and time.monotonic() < deadline:
                time.sleep(0.01)


class FaultyConnector(KVStoreConnector):
    """`KVStoreConnector` with the faults of this module's docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        worker = self._worker
        if worker is not None:
            real_load = worker._load

            def held_load(load: Any, worker: WorkerSide = worker) -> tuple[int, ...]:
                _hold(worker.rank)
                return real_load(load)

            worker._load = held_load  # type: ignore[method-assign]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        folder = fault_dir()
        if folder is not None and self.has_connector_metadata():
            held = (p for p in folder.glob("hold-loads-rank-*") if p.suffix != ".reached")
            if any(held):
                self._meta().idle = False
        super().start_load_kv(forward_context, **kwargs)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        folder = fault_dir()
        side = self._scheduler
        if folder is not None and side is not None and (folder / "leak-pins").exists():
            for load in meta.loads:
                tracked = side._requests.get(load.request_id)
                if tracked is not None and tracked.hits is not None:
                    side.link.release(tracked.hits[load.unit])
        return meta
