"""vLLM's KV-event format, both ways (docs/events.md).

- `wire`: the msgpack batches (BlockStored / BlockRemoved / AllBlocksCleared),
  both encodings, and the frames' sequence numbers.
- `publisher`: `KvEventPublisher`, the node's own block events on a ZMQ PUB
  socket with a replay ROUTER, sent from a thread off the event loop.
- `engine_index`: `EngineIndex`, which blocks each serving engine of the
  node holds, re-keyed into kvstore chain hashes (`longest`, `blocks`).
- `subscriber`: `EngineSubscriber`, one engine's events into the index
  (sequence gaps replayed, restarts and bad input counted).
- `wiring`: `KvEvents`, what the node starts and stops.

pyzmq and msgpack come with the ``events`` extra and are imported only when
a setting turns a side on.
"""
