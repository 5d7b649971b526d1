"""The node's cluster on Redis: registry, block directory, events, peer fetch.

- `redis_link`: the Redis connection (single Redis or Redis Cluster),
  `LuaScript`, `REDIS_ERRORS` and the reconnect backoff (redis-py's own).
- `keys`: every key name and the byte packing of directory members.
- `registry`: live nodes with heartbeat TTLs; `directory`: which node holds
  which blocks, and the bounded queue of changes; `event_stream`: the
  cluster-wide event stream.
- `agent`: `RedisAgent`, the one task that writes to Redis (heartbeat,
  flushes, resync after an outage); `peer_fetch`: copies missed blocks from
  a peer the directory names (`fetch_lease`: the lease it writes under).
- NIXL, the data plane of peer fetch (docs/cluster.md): `nixl_transport`
  starts it as `peer_transport` says; `nixl_agent` (the only module that
  imports `nixl`) registers the pool arenas and moves bytes; `nixl_offers`
  is the holder's side, `nixl_fetch` the reader's.
- `local`: `LocalNode`, what the agent and the fetcher need of the node (a
  protocol, so this package never imports `service.node`).
"""
