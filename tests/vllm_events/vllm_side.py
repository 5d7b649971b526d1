"""Scripts run by vLLM's own python (``$KVSTORE_VLLM_PYTHON``): vLLM's classes on the other end.

- ``decode ENDPOINT REPLAY``: asks the replay socket for every batch from 0,
  then subscribes; prints one JSON line per batch, decoded with vLLM's
  ``msgspec`` decoder of ``KVEventBatch`` (``{"seq", "replayed", "events"}``,
  hashes in hex), and ``ready`` between the two; exits on stdin EOF.
- ``publish ENDPOINT REPLAY``: vLLM's ``ZmqEventPublisher``; reads one JSON
  batch per stdin line (events as plain objects) and publishes it with
  vLLM's classes; prints ``ready`` once bound.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__)


def vllm_python() -> str | None:
    """The python of the vLLM environment, or None (tests then skip)."""
    path = os.environ.get("KVSTORE_VLLM_PYTHON", "")
    return path if path and Path(path).exists() else None


def start(python: str, mode: str, endpoint: str, replay: str) -> subprocess.Popen[str]:
    """Start this script in vLLM's python (stdin/stdout pipes, text)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.Popen(
        [python, str(SCRIPT), mode, endpoint, replay],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def _event_json(ev):  # pragma: no cover - runs in vLLM's python
    def h(x):
        return x.hex() if isinstance(x, bytes) else x

    doc = {"type": type(ev).__name__}
    for name in ev.__struct_fields__:
        value = getattr(ev, name)
        if name == "block_hashes":
            value = [h(x) for x in value]
        elif name == "parent_block_hash":
            value = h(value)
        doc[name] = value
    return doc


def _decode(endpoint: str, replay: str) -> None:  # pragma: no cover - runs in vLLM's python
    import json
    import threading

    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    ctx = zmq.Context()

    def show(seq: int, payload: bytes, replayed: bool) -> None:
        batch = decoder.decode(payload)
        events = [_event_json(e) for e in batch.events]
        print(json.dumps({"seq": seq, "replayed": replayed, "ts": batch.ts, "events": events}))
        sys.stdout.flush()

    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    while True:
        _, _topic, seq, payload = dealer.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        show(int.from_bytes(seq, "big"), payload, True)
    print("ready", flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    while True:
        _topic, seq, payload = sub.recv_multipart()
        show(int.from_bytes(seq, "big"), payload, False)


def _publish(endpoint: str, replay: str) -> None:  # pragma: no cover - runs in vLLM's python
    import json
    import time

    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    def h(x):
        return bytes.fromhex(x) if isinstance(x, str) else x

    pub = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay or None)
    print("ready", flush=True)
    for line in sys.stdin:
        doc = json.loads(line)
        events = []
        for e in doc["events"]:
            if e["type"] == "BlockStored":
                events.append(
                    BlockStored(
                        block_hashes=[h(x) for x in e["block_hashes"]],
                        parent_block_hash=h(e["parent"]) if e["parent"] is not None else None,
                        token_ids=e["token_ids"],
                        block_size=e["block_size"],
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                    )
                )
            elif e["type"] == "BlockRemoved":
                events.append(
                    BlockRemoved(block_hashes=[h(x) for x in e["block_hashes"]], medium="GPU")
                )
            else:
                events.append(AllBlocksCleared())
        pub.publish(KVEventBatch(ts=time.time(), events=events))
        print("sent", flush=True)
    pub.shutdown()


if __name__ == "__main__":  # pragma: no cover - runs in vLLM's python
    {"decode": _decode, "publish": _publish}[sys.argv[1]](sys.argv[2], sys.argv[3])
