"""A hand-built engine publisher: raw ZMQ PUB frames and a replay ROUTER, any payload.

Unlike vLLM's ``ZmqEventPublisher`` it lets a test choose each sequence
number, keep a batch for replay without sending it (a missed batch), and
send malformed messages.
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int], *, array: bool = False):
    """A BlockStored event in either encoding."""
    if array:
        return ["BlockStored", hashes, parent, tokens, 4, None, "GPU", None]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def removed(hashes: list[bytes], *, array: bool = False):
    """A BlockRemoved event in either encoding."""
    if array:
        return ["BlockRemoved", hashes, "GPU"]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def batch(events: list[Any], *, as_map: bool = False) -> bytes:
    """A KVEventBatch payload (an array, or the map form)."""
    if as_map:
        return msgpack.packb({"ts": 1.0, "events": events, "data_parallel_rank": 0})
    return msgpack.packb([1.0, events, 0])


class FakeEngine:
    """PUB + replay ROUTER on free localhost ports; the ROUTER answers on a thread."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.kept: dict[int, bytes] = {}
        self.replays = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def keep(self, seq: int, payload: bytes) -> None:
        """Keep a batch for replay only (as if subscribers had missed it)."""
        with self._lock:
            self.kept[seq] = payload

    def send(self, seq: int, payload: bytes, topic: bytes = b"") -> None:
        """Publish a batch (and keep it for replay)."""
        self.keep(seq, payload)
        self.pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])

    def send_raw(self, frames: list[bytes]) -> None:
        """Publish arbitrary frames."""
        self.pub.send_multipart(frames)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            identity, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            with self._lock:
                kept = sorted((s, p) for s, p in self.kept.items() if s >= first)
                self.replays += 1
            for seq, payload in kept:
                self.router.send_multipart([identity, b"", b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([identity, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        """Stop the ROUTER thread and close everything."""
        self._stop.set()
        self._thread.join(5)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()
