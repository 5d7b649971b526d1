"""Subscribes to one engine's vLLM KV events and feeds them to the engine index.

One asyncio task per engine (`zmq.asyncio`, on the node's loop: ingesting
is synchronous bookkeeping plus SHA-256 over a batch's tokens). A SUB socket
connects to the engine's publisher and reads ``[topic, seq, payload]``.

Sequence numbers (8 bytes, big-endian) increase by one per batch:

- a gap (``seq > last + 1``, or the first batch when a replay endpoint is
  set) asks the engine's replay ROUTER for the batches from ``last + 1``
  (a DEALER sends ``[b"", seq]``; replies ``[b"", topic, seq, payload]``
  end with the sequence ``-1``), ingests those it did not have, then the
  batch at hand; batches the replay no longer holds are counted as ``gaps``
  (their blocks' children then count as ``unknown_parent``);
- ``seq <= last`` means the publisher restarted (vLLM numbers from 0 on
  each start): the engine's blocks are dropped (``restarts``) and indexing
  starts over.

Malformed messages are counted (``malformed``), logged once, and skipped;
nothing an engine sends can stop the task. pyzmq comes with the ``events``
extra and is imported only here and in `service.vllm_events.publisher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from typing import Any

from kvstore.extras import MissingExtra
from service.config import ConfigError
from service.config.engines import EngineSource
from service.vllm_events.engine_index import EngineIndex
from service.vllm_events.wire import END_SEQ, WireError, decode_batch, seq_bytes

log = logging.getLogger(__name__)

REPLAY_TIMEOUT = 2.0
"""Seconds a replay may take before the gap is counted and ingestion goes on."""


def zmq_modules() -> tuple[Any, Any]:
    """``(zmq, zmq.asyncio)``, or `MissingExtra` naming the ``events`` extra."""
    try:
        return importlib.import_module("zmq"), importlib.import_module("zmq.asyncio")
    except ImportError as exc:
        raise MissingExtra(
            "vLLM KV events need pyzmq and msgpack: pip install 'kvstore[events]'"
        ) from exc


class EngineSubscriber:
    """The SUB (and replay DEALER) sockets of one engine, and the task reading them."""

    def __init__(self, source: EngineSource, index: EngineIndex, context: Any) -> None:
        self.source = source
        self.index = index
        self._zmq, _ = zmq_modules()
        self._ctx = context
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._pending_gap: tuple[int, int, bytes] | None = None
        """(first missing seq, seq at hand, its payload): a replay to run before ingesting."""

    @property
    def name(self) -> str:
        """The engine's name."""
        return self.source.name

    def start(self) -> None:
        """Connect and start reading (the engine may not be up yet: ZMQ reconnects).

        Raises:
            ConfigError: the endpoint is malformed.
        """
        zmq = self._zmq
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        try:
            self._sub.connect(self.source.endpoint)
        except zmq.ZMQError as exc:
            self._sub.close(linger=0)
            self._sub = None
            raise ConfigError(
                f"engine_kv_events {self.name}: endpoint {self.source.endpoint!r}: {exc}"
            ) from None
        self._sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        self._task = asyncio.create_task(self._run(), name=f"kvstore-engine-{self.name}")

    async def stop(self) -> None:
        """Stop reading and close the sockets."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    async def _run(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            try:
                self._on_message(frames)
                if self._pending_gap is not None:
                    await self._catch_up(*self._pending_gap)
            except Exception:  # never let one engine's input end the task
                log.exception("bug: engine %s: ingesting a batch failed", self.name)
                self.index.engines[self.name].count("errors")
                self._pending_gap = None

    def _on_message(self, frames: list[bytes]) -> None:
        """Ingest one ``[topic, seq, payload]`` message (or note a gap to replay first)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.index.skip(self.name, "malformed", 1, f"a message of {len(frames)} frames")
            return
        seq = int.from_bytes(frames[1], "big")
        state = self.index.engines[self.name]
        last = state.last_seq
        if last is not None and seq <= last:
            state.count("restarts")
            log.info("engine %s restarted its publisher (seq %d after %d)", self.name, seq, last)
            self.index.clear(self.name)
            state.last_seq = None
            last = None
        expected = 0 if last is None else last + 1
        if seq > expected and (last is not None or self.source.replay_endpoint):
            if self.source.replay_endpoint:
                self._pending_gap = (expected, seq, frames[2])
                return
            state.count("gaps", seq - expected)
        self._ingest(seq, frames[2])

    def _ingest(self, seq: int, payload: bytes) -> None:
        state = self.index.engines[self.name]
        try:
            batch = decode_batch(payload)
        except WireError as exc:
            self.index.skip(self.name, "malformed", 1, f"undecodable batch {seq}: {exc}")
            state.last_seq = seq
            return
        self.index.ingest(self.name, batch)
        state.last_seq = seq

    async def _catch_up(self, start: int, seq: int, payload: bytes) -> None:
        """Replay batches ``start .. seq - 1``, then ingest batch ``seq``."""
        self._pending_gap = None
        state = self.index.engines[self.name]
        got = 0
        try:
            async with asyncio.timeout(REPLAY_TIMEOUT):
                got = await self._replay(start, seq)
        except TimeoutError:
            log.info("engine %s: replay from %d timed out", self.name, start)
        except Exception as exc:  # a bad replay reply must not end ingestion
            self.index.skip(self.name, "malformed", 1, f"replay failed: {exc}")
        state.count("replayed", got)
        resumed = state.last_seq + 1 if state.last_seq is not None else start
        if seq > resumed:
            state.count("gaps", seq - resumed)
        self._ingest(seq, payload)

    async def _replay(self, start: int, stop: int) -> int:
        """Ingest the replayed batches in ``[start, stop)``; returns how many."""
        zmq = self._zmq
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        got = 0
        try:
            dealer.connect(self.source.replay_endpoint)
            await dealer.send_multipart([b"", seq_bytes(start)])
            while True:
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[0] != b"":
                    raise WireError(f"a replay reply of {len(frames)} frames")
                if frames[2] == END_SEQ:
                    return got
                seq = int.from_bytes(frames[2], "big")
                last = self.index.engines[self.name].last_seq
                if start <= seq < stop and (last is None or seq > last):
                    self._ingest(seq, frames[3])
                    got += 1
        finally:
            dealer.close(linger=0)
