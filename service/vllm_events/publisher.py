"""Publishes the node's own block events in vLLM's KV-event format, on ZMQ.

So a router that indexes vLLM engines from their KV events (llm-d's
KV-cache indexer, Dynamo's KV router) can count the node as one more cache
tier: it subscribes to ``kv_events_endpoint`` like to an engine.

- Each `Node.publish_events` call with block events becomes one
  ``KVEventBatch`` (`service.vllm_events.wire`): STORED -> BlockStored, REMOVED ->
  BlockRemoved, both naming ``kv_events_medium``; the disk tier's blocks
  (`service.disk.holdings`) name ``"disk"``. CLEARED is not sent: a
  namespace clear already sends BlockRemoved for its blocks, and vLLM's
  AllBlocksCleared means "everything this publisher holds".
- Block hashes are the node's 32-byte chain hashes, as msgpack bin (vLLM's
  ``ExternalBlockHash`` is ``bytes | int``; bytes is its default). The node
  keys blocks by hash and never sees their tokens, so ``token_ids`` is
  empty; ``block_size`` is the namespace's; ``lora_id`` / ``lora_name`` nil.
- The event loop only converts to plain lists and dicts and enqueues (``put_nowait`` on a bounded
  queue: when the sender falls ``kv_events_buffer_batches`` behind, batches
  are dropped and counted, never waited for). A daemon thread owns the
  sockets: it encodes (msgpack), numbers (0, 1, 2, ... per node start, 8-byte
  big-endian), sends ``[topic, seq, payload]`` on the PUB socket, keeps the
  last ``kv_events_buffer_batches`` payloads, and answers replay requests on
  the ROUTER socket (``[identity, b"", start seq]`` -> every kept batch from
  ``start`` as ``[identity, b"", topic, seq, payload]``, then
  ``[identity, b"", b"", -1, b""]``), as vLLM's ``ZmqEventPublisher`` does.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kvstore.events import CacheEvent, EventKind
from kvstore.types import NamespaceId
from service.vllm_events import wire
from service.vllm_events.subscriber import zmq_modules

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05
"""Longest the sender waits for a batch before it looks at the replay socket again."""


class KvEventPublisher:
    """PUB + replay ROUTER sockets fed from the loop through a bounded queue."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str = "",
        topic: str = "",
        medium: str,
        buffer_batches: int = 10_000,
        array_events: bool = False,
        block_size_of: Callable[[NamespaceId], int | None],
        wall: Callable[[], float],
    ) -> None:
        """Bind the sockets (raises ``zmq.ZMQError`` on a bad or busy endpoint)."""
        self._zmq, _ = zmq_modules()
        zmq = self._zmq
        self.medium = medium
        self.topic = topic.encode()
        self._array = array_events
        self._block_size_of = block_size_of
        self._wall = wall
        # (ts, events): msgpack encoding happens on the sender thread, not the loop.
        self._queue: queue.Queue[tuple[float, list[Any]] | None] = queue.Queue(
            maxsize=buffer_batches
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self.dropped = 0
        """Batches dropped because the sender thread fell behind."""
        self.sent = 0
        """Batches sent (the next sequence number)."""
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: Any = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound PUB endpoint (the port chosen when the setting asked for port 0)."""
        self.replay_endpoint = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else ""
        )
        self._thread = threading.Thread(target=self._send_forever, name="kvstore-kv-events")
        self._thread.daemon = True
        self._thread.start()

    # --- loop side --------------------------------------------------------------

    def publish(self, events: Iterable[CacheEvent], medium: str | None = None) -> None:
        """Convert ``events`` into one batch and queue it; never blocks. ``medium``: the
        events' medium when not this publisher's (the disk tier's blocks)."""
        medium = medium or self.medium
        wire_events: list[Any] = []
        for ev in events:
            if ev.kind is EventKind.STORED:
                size = self._block_size_of(ev.namespace)
                if size is None:
                    continue
                wire_events.append(
                    wire.stored(ev.hashes, ev.parent, size, medium, array=self._array)
                )
            elif ev.kind is EventKind.REMOVED and ev.hashes:
                wire_events.append(wire.removed(ev.hashes, medium, array=self._array))
        if not wire_events:
            return
        try:
            self._queue.put_nowait((self._wall(), wire_events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("KV-event sender is behind: dropping batches (counted)")

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (within ``timeout``), stop the thread, close the sockets."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("KV-event sender did not drain its queue; closing anyway")
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("KV-event sender thread did not stop within %.1fs", timeout)
            return  # it owns the sockets: never close them under it
        self._close_sockets()

    # --- sender thread ----------------------------------------------------------

    def _send_forever(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    log.exception("KV-event replay request failed")
            try:
                item = self._queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if item is None:
                return
            seq = self.sent
            payload = wire.encode_batch(*item)
            try:
                self._pub.send_multipart([self.topic, wire.seq_bytes(seq), payload])
            except Exception:
                log.exception("KV-event send failed (batch %d kept for replay)", seq)
            self._buffer.append((seq, payload))
            self.sent = seq + 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.info("ignored a malformed KV-event replay request (%d frames)", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart(
                    [identity, b"", self.topic, wire.seq_bytes(seq), payload]
                )
        self._replay.send_multipart([identity, b"", b"", wire.END_SEQ, b""])

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
