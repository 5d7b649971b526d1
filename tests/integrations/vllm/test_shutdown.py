"""`on_stop`: a close runs once on exit, SIGTERM and SIGINT, and the process still stops.

Each case is a plain python subprocess (no vLLM): it registers a close that
appends a line to a file, says it is ready, and is then stopped.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.integrations.vllm.engines import ROOT

WAIT = 30.0  # seconds for a child to get ready or to exit

PRELUDE = """
import os, signal, sys, time
from pathlib import Path
from kvstore.integrations.vllm.shutdown import on_stop

OUT = Path(sys.argv[1])

def note(line):
    with OUT.open("a") as f:
        f.write(line + "\\n")

class Connector:
    def shutdown(self):
        note("closed")

def ready_then_wait():
    print("ready", flush=True)
    deadline = time.monotonic() + 60  # the parent stops us long before
    while time.monotonic() < deadline:
        time.sleep(0.05)
    note("not stopped")
"""


REGISTER_AND_WAIT = "connector = Connector(); on_stop(connector.shutdown); ready_then_wait()"


def start(tmp_path: Path, body: str) -> tuple[subprocess.Popen[str], Path]:
    """Run PRELUDE + ``body``; returns the process once it printed ``ready``, and its file."""
    script = tmp_path / "child.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    out = tmp_path / "out.txt"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if not selector.select(WAIT):
            proc.kill()
            raise TimeoutError(f"child not ready: {proc.communicate()}")
    line = proc.stdout.readline()
    assert line == "ready\n", (line, proc.communicate())
    return proc, out


def finish(proc: subprocess.Popen[str]) -> int:
    """The child's exit code, once it exited by itself (bounded); its stderr in `errors`."""
    try:
        _, errors[proc.pid] = proc.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode


errors: dict[int, str] = {}


def lines(out: Path) -> list[str]:
    return out.read_text().splitlines() if out.exists() else []


def test_sigterm_closes_then_the_process_dies_of_it(tmp_path: Path) -> None:
    proc, out = start(tmp_path, REGISTER_AND_WAIT)
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == -signal.SIGTERM  # the default action, as without on_stop
    assert lines(out) == ["closed"]


def test_sigint_closes_once_then_keyboard_interrupt(tmp_path: Path) -> None:
    proc, out = start(tmp_path, REGISTER_AND_WAIT)
    proc.send_signal(signal.SIGINT)
    code = finish(proc)
    assert code != 0
    assert "KeyboardInterrupt" in errors[proc.pid]
    assert lines(out) == ["closed"]  # the atexit after the KeyboardInterrupt does not repeat it


def test_normal_exit_closes_once(tmp_path: Path) -> None:
    proc, out = start(
        tmp_path,
        """
        connector = Connector()
        on_stop(connector.shutdown)
        on_stop(connector.shutdown)  # two registrations, two closes: each runs once
        print("ready", flush=True)
        """,
    )
    assert finish(proc) == 0
    assert lines(out) == ["closed", "closed"]


def test_a_previous_handler_runs_after_the_close(tmp_path: Path) -> None:
    """As in vLLM's EngineCore: its own SIGTERM handler asks the loop to stop."""
    proc, out = start(
        tmp_path,
        """
        stop = False
        def previous(signum, frame):
            global stop
            note("previous")
            stop = True
        signal.signal(signal.SIGTERM, previous)
        connector = Connector()
        on_stop(connector.shutdown)
        print("ready", flush=True)
        deadline = time.monotonic() + 60
        while not stop and time.monotonic() < deadline:
            time.sleep(0.05)
        note("loop left")
        """,
    )
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == 0
    assert lines(out) == ["closed", "previous", "loop left"]


def test_a_failing_close_neither_raises_nor_stops_the_others(tmp_path: Path) -> None:
    proc, out = start(
        tmp_path,
        """
        def broken():
            note("broken")
            raise RuntimeError("node gone")
        connector = Connector()
        on_stop(connector.shutdown)
        on_stop(broken)
        ready_then_wait()
        """,
    )
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == -signal.SIGTERM
    assert lines(out) == ["broken", "closed"]  # newest first


def test_a_forked_child_never_closes_its_parents_connector(tmp_path: Path) -> None:
    proc, out = start(
        tmp_path,
        """
        connector = Connector()
        on_stop(connector.shutdown)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: runs atexit in the child
        os.waitpid(pid, 0)
        note("child gone")
        ready_then_wait()
        """,
    )
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == -signal.SIGTERM
    assert lines(out) == ["child gone", "closed"]


def test_a_collected_connector_is_not_kept_alive_nor_closed(tmp_path: Path) -> None:
    proc, out = start(
        tmp_path,
        """
        import gc, weakref
        connector = Connector()
        on_stop(connector.shutdown)
        alive = weakref.ref(connector)
        del connector
        gc.collect()
        note(f"alive={alive() is not None}")
        print("ready", flush=True)
        """,
    )
    assert finish(proc) == 0
    assert lines(out) == ["alive=False"]


def test_a_close_that_hangs_delays_the_stop_by_a_bounded_time(tmp_path: Path) -> None:
    proc, out = start(
        tmp_path,
        """
        import kvstore.integrations.vllm.shutdown as shutdown
        shutdown.SIGNAL_CLOSE_TIMEOUT = 0.5
        def hang():
            note("hanging")
            time.sleep(60)
        on_stop(hang)
        ready_then_wait()
        """,
    )
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == -signal.SIGTERM
    assert time.monotonic() - started < 10
    assert lines(out) == ["hanging"]
