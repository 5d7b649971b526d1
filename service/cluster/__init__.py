"""The node's cluster on Redis: registry, block directory, events, peer fetch.

- `link`: the Redis connection (single Redis or Redis Cluster), `LuaScript`,
  `REDIS_ERRORS` and the reconnect backoff (redis-py's own).
- `keys`: every key name and the byte packing of directory members.
- `registry`: live nodes with heartbeat TTLs; `directory`: which node holds
  which blocks, and the bounded queue of changes; `events`: the cluster-wide
  event stream.
- `agent`: `RedisAgent`, the one task that writes to Redis (heartbeat,
  flushes, resync after an outage); `peer_fetch`: copies missed blocks from
  a peer the directory names.
- `local`: `LocalNode`, what the agent and the fetcher need of the node (a
  protocol, so this package never imports `service.node`).
"""
