"""A CUDA node process (``python -m service --device cuda:0``) for the GPU tests."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Node:
    """A node process serving CUDA pools on GPU 0; `stop` sends SIGTERM."""

    def __init__(self, tmp: Path) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "service", "--device", "cuda:0", "--port", "0",
                "--metrics-port", "0", "--capacity", "1GiB", "--shm-dir", str(tmp),
                "--lease-ttl-default", "2",
            ],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("kvstore-server listening on"):
            self.proc.kill()
            raise AssertionError(f"server did not start: {line!r} {self.proc.stderr.read()}")
        self.address = line.split()[-1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
