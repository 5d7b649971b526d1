"""The node registry on Redis: who is alive, where, with what capacity.

Each node's heartbeat runs `HEARTBEAT` every `heartbeat_seconds`: it writes
the node's info, pushes its deadline (Redis ``TIME`` + `node_ttl_seconds`)
in the ``alive`` ZSET, appends NODE_JOINED to the event stream when the node
was not alive before, and reaps every node whose deadline has passed
(removing it and appending NODE_LEFT, exactly once, atomically). Readers
(`live_nodes`) filter by deadline with Redis's clock too, so a node that
stops heartbeating disappears from every answer after at most its TTL,
whether or not anyone reaped it yet, and no node clock is ever compared to
another's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from service.cluster.keys import Keys
from service.cluster.redis_link import LuaScript

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local at = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
"""

HEARTBEAT = LuaScript(
    _NOW
    + """
-- KEYS[1] nodes hash, KEYS[2] alive zset, KEYS[3] event stream
-- ARGV[1] node id, ARGV[2] info json, ARGV[3] ttl ms, ARGV[4] stream maxlen
local old = redis.call('ZSCORE', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local joined = 0
if (not old) or tonumber(old) < now then
  joined = 1
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*',
             'kind', 'node_joined', 'node', ARGV[1], 'at', at)
end
local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. now)
for _, id in ipairs(dead) do
  redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[1], id)
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*',
             'kind', 'node_left', 'node', id, 'at', at)
end
return {joined, dead}
"""
)

LEAVE = LuaScript(
    _NOW
    + """
-- KEYS as HEARTBEAT; ARGV[1] node id, ARGV[2] stream maxlen
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*',
             'kind', 'node_left', 'node', ARGV[1], 'at', at)
end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
"""
)

LIVE = LuaScript(
    _NOW
    + """
-- KEYS[1] nodes hash, KEYS[2] alive zset
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], now, '+inf')
if #ids == 0 then return {} end
local infos = redis.call('HMGET', KEYS[1], unpack(ids))
local out = {}
for i, id in ipairs(ids) do
  if infos[i] then out[#out + 1] = infos[i] end
end
return out
"""
)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What the registry says about one node."""

    node_id: str
    """The node's id."""
    address: str
    """gRPC address (``host:port``) peers and runners reach it at."""
    devices: tuple[str, ...] = ("cpu",)
    """Devices its pools live on."""
    capacity_bytes: int = 0
    """Its memory budget."""
    used_bytes: int = 0
    """Bytes of READY and WRITING blocks."""
    version: str = ""
    """kvstore version it runs."""
    epoch: int = 0
    """Pool epoch (changes on restart)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields a newer node wrote that this version does not know."""

    def to_json(self) -> str:
        """The registry's stored form."""
        return json.dumps(
            {
                "node_id": self.node_id,
                "address": self.address,
                "devices": list(self.devices),
                "capacity_bytes": self.capacity_bytes,
                "used_bytes": self.used_bytes,
                "version": self.version,
                "epoch": self.epoch,
                **self.extra,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeInfo:
        """Parse the stored form (unknown fields are kept in `extra`)."""
        doc = json.loads(raw)
        known = {"node_id", "address", "devices", "capacity_bytes", "used_bytes", "version"}
        return cls(
            node_id=str(doc.get("node_id", "")),
            address=str(doc.get("address", "")),
            devices=tuple(doc.get("devices", ())),
            capacity_bytes=int(doc.get("capacity_bytes", 0)),
            used_bytes=int(doc.get("used_bytes", 0)),
            version=str(doc.get("version", "")),
            epoch=int(doc.get("epoch", 0)),
            extra={k: v for k, v in doc.items() if k not in known | {"epoch"}},
        )


class Registry:
    """Heartbeats, departures and listings of the cluster's nodes."""

    def __init__(self, keys: Keys, ttl_ms: int, stream_maxlen: int) -> None:
        self.keys = keys
        self.ttl_ms = ttl_ms
        self.stream_maxlen = stream_maxlen

    @property
    def _keys(self) -> tuple[str, str, str]:
        return (self.keys.nodes, self.keys.alive, self.keys.events)

    async def heartbeat(self, client: Any, info: NodeInfo) -> tuple[bool, list[str]]:
        """Refresh ``info``'s deadline; returns (whether it joined now, nodes reaped)."""
        joined, dead = await HEARTBEAT(
            client, self._keys, (info.node_id, info.to_json(), self.ttl_ms, self.stream_maxlen)
        )
        return bool(joined), [d.decode() if isinstance(d, bytes) else d for d in dead]

    async def leave(self, client: Any, node_id: str) -> None:
        """Remove ``node_id`` now (graceful shutdown), with its NODE_LEFT event."""
        await LEAVE(client, self._keys, (node_id, self.stream_maxlen))

    async def live_nodes(self, client: Any) -> list[NodeInfo]:
        """Every node whose heartbeat deadline has not passed, by id."""
        raw = await LIVE(client, self._keys[:2], ())
        return sorted((NodeInfo.from_json(r) for r in raw), key=lambda n: n.node_id)
