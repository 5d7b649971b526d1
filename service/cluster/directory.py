"""The block directory: which live nodes hold which blocks, on Redis.

Writes are batched: the node's committed and evicted blocks go into a
bounded `DirectoryQueue` (synchronous, from `Node.publish_events`); the
agent drains it every `directory_flush_seconds` into one pipeline of
``SADD`` / ``SREM`` / ``PEXPIRE`` per (namespace, node) set.

Reads are one round trip: `Directory.locate` runs `LOCATE`, which reads
Redis ``TIME``, takes the namespace's live nodes (heartbeat deadline in the
future), and counts for each how long a prefix of the chain its set holds.
A dead node's entries therefore never win, even in the seconds before its
sets expire (they carry the node TTL and are refreshed by its heartbeat).
Every key a script touches is in the namespace's hash slot (see
`service.cluster.keys`), so it runs unchanged on Redis Cluster.

Routers' prefix queries are one round trip too: `Directory.query` runs
`QUERY`, which is `LOCATE` for every live node (this one included) plus the
engines attached to live nodes: ``{P:ns}:engines`` (HASH ``<node>:<engine>``
-> JSON ``{"node", "engine", "medium"}``) names them, and each engine's
``{P:ns}:e:<node>:<engine>`` SET holds members exactly like a node's set.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Protocol, TypeVar

from kvstore.types import BlockHash, NamespaceId, TenantId
from service.cluster.keys import Keys, member
from service.cluster.redis_link import LuaScript

_HELD = """
-- held(key, disk, known): how many leading chain members (ARGV[4..]) the set at
-- key holds, or with disk (a node's disk set, skipped when absent) either set
-- holds; the first known members are taken as held. SMISMEMBER in chunks of
-- 1,000, stopping at the first miss.
local function held(key, disk, known)
  local n = known or 0
  local first = 4 + n
  if disk and redis.call('EXISTS', disk) == 0 then disk = nil end
  while first <= #ARGV do
    local last = math.min(first + 999, #ARGV)
    local flags = redis.call('SMISMEMBER', key, unpack(ARGV, first, last))
    local dflags = disk and redis.call('SMISMEMBER', disk, unpack(ARGV, first, last))
    local run = 0
    for i = 1, #flags do
      if flags[i] == 1 or (dflags and dflags[i] == 1) then run = run + 1 else break end
    end
    n = n + run
    if run < #flags then break end
    first = last + 1
  end
  return n
end
"""

LOCATE = LuaScript(
    """
-- KEYS[1] ns alive zset, KEYS[2] ns addr hash
-- ARGV[1] node-set key prefix, ARGV[2] node id to skip, ARGV[3] disk-set key prefix,
-- ARGV[4..] chain members. A node holds a block in its pool or on its disk.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
    + _HELD
    + """
local live = redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')
local total = #ARGV - 3
local out = {}
for _, id in ipairs(live) do
  if id ~= ARGV[2] then
    local n = held(ARGV[1] .. id, ARGV[3] .. id)
    if n > 0 then
      local addr = redis.call('HGET', KEYS[2], id) or ''
      out[#out + 1] = id
      out[#out + 1] = addr
      out[#out + 1] = n
    end
  end
end
return {total, out}
"""
)

QUERY = LuaScript(
    """
-- KEYS[1] ns alive zset, KEYS[2] ns addr hash, KEYS[3] ns engines hash
-- ARGV[1] node-set key prefix, ARGV[2] engine-set key prefix, ARGV[3] disk-set key
-- prefix, ARGV[4..] chain members
-- Returns {chain length, {node, address, held, engine, medium, ...}}; engine ''
-- is the node's own pool (medium ''), or its pool and disk tier together (medium
-- 'disk', listed when the disk carries the run past the pool's). Only holders of
-- at least the first block are listed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
    + _HELD
    + """local out = {}
local function add(id, n, engine, medium)
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', KEYS[2], id) or ''
  out[#out + 1] = n
  out[#out + 1] = engine
  out[#out + 1] = medium
end
local alive = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do
  alive[id] = true
  local n = held(ARGV[1] .. id)
  if n > 0 then add(id, n, '', '') end
  if redis.call('EXISTS', ARGV[3] .. id) == 1 then
    local d = held(ARGV[1] .. id, ARGV[3] .. id, n)
    if d > n then add(id, d, '', 'disk') end
  end
end
local engines = redis.call('HGETALL', KEYS[3])
for i = 1, #engines, 2 do
  local ok, info = pcall(cjson.decode, engines[i + 1])
  if ok and type(info) == 'table' and type(info.node) == 'string' and alive[info.node] then
    local n = held(ARGV[2] .. engines[i])
    if n > 0 then
      local engine = info.engine
      if type(engine) ~= 'string' then engine = engines[i] end
      local medium = info.medium
      if type(medium) ~= 'string' then medium = '' end
      add(info.node, n, engine, medium)
    end
  end
end
return {#ARGV - 3, out}
"""
)

NS_HEARTBEAT = LuaScript("""
-- KEYS[1] ns alive zset, KEYS[2] ns addr hash, KEYS[3] this node's set,
-- KEYS[4] ns engines hash (fields "<node>:<engine>", docs/events.md), KEYS[5] this
-- node's disk set
-- ARGV[1] node id, ARGV[2] address, ARGV[3] ttl ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[3], ttl)
redis.call('PEXPIRE', KEYS[5], ttl)
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
for _, id in ipairs(dead) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
end
-- Engine entries of nodes that are not live: their sets expire by TTL, their
-- fields would not (engine names hold no ':', the node id is before the last one).
for _, field in ipairs(redis.call('HKEYS', KEYS[4])) do
  local node = string.match(field, '^(.*):[^:]*$')
  local deadline = node and redis.call('ZSCORE', KEYS[1], node)
  if not deadline or tonumber(deadline) < now then
    redis.call('HDEL', KEYS[4], field)
  end
end
return #dead
""")


@dataclass(frozen=True, slots=True)
class PeerHolder:
    """A live node that holds a prefix of a chain."""

    node_id: str
    """The node's id."""
    address: str
    """Its gRPC address (where FetchBlocks goes)."""
    blocks: int
    """Length of the chain prefix it holds."""


@dataclass(frozen=True, slots=True)
class TierHolder:
    """A live node's pool, or an engine attached to a live node, holding a prefix of a chain."""

    node_id: str
    """The node's id (the engine's node for an engine)."""
    address: str
    """The node's gRPC address."""
    blocks: int
    """Length of the chain prefix it holds."""
    engine: str = ""
    """The engine's name; "" for the node's own pool."""
    medium: str = ""
    """The engine's medium ("GPU", ...); "" for the node's own pool, "disk" for its pool
    and disk tier together."""


class Change(Enum):
    """What one queued directory change does."""

    ADD = "add"
    REMOVE = "remove"


@dataclass(frozen=True, slots=True)
class QueuedChange:
    """Blocks added to or removed from this node's set of one namespace."""

    change: Change
    namespace: NamespaceId
    members: tuple[bytes, ...]
    disk: bool = False
    """The node's disk set (``{P:ns}:d:<node>``), not its pool's."""


class _HasMembers(Protocol):
    @property
    def members(self) -> tuple[bytes, ...]: ...


C = TypeVar("C", bound=_HasMembers)


class ChangeQueue(Generic[C]):
    """Bounded buffer of set changes awaiting a flush (bookkeeping only, no I/O).

    Bounded in members (blocks), not changes: one STORED event may carry a
    thousand blocks. Past the bound everything queued is dropped and
    `needs_resync` is set: a full resync rewrites the node's entries from
    their source, which is what the dropped changes would have converged to.
    The node's directory (`DirectoryQueue`) and its engines' sets
    (`service.cluster.engine_sets.EngineSetQueue`) queue this way.
    """

    def __init__(self, limit_blocks: int) -> None:
        self.limit = limit_blocks
        self._changes: deque[C] = deque()
        self.blocks = 0
        """Blocks (set members) in the queue."""
        self.needs_resync = True
        """Set at start and after any loss; the agent resyncs before flushing."""
        self.dropped = 0
        """Blocks dropped on overflow, ever."""

    def __len__(self) -> int:
        return len(self._changes)

    def append(self, item: C) -> bool:
        """Queue one change; on overflow drop everything, ask for a resync, return False."""
        if self.blocks + len(item.members) > self.limit:
            self.dropped += self.blocks + len(item.members)
            self.clear()
            self.needs_resync = True
            return False
        self._changes.append(item)
        self.blocks += len(item.members)
        return True

    def take(self, max_blocks: int) -> list[C]:
        """Up to about ``max_blocks`` blocks of changes, oldest first (at least one change)."""
        taken: list[C] = []
        count = 0
        while self._changes and (not taken or count + len(self._changes[0].members) <= max_blocks):
            item = self._changes.popleft()
            taken.append(item)
            count += len(item.members)
        self.blocks -= count
        return taken

    def clear(self) -> None:
        """Forget every queued change (a resync snapshot replaces them)."""
        self._changes.clear()
        self.blocks = 0


class DirectoryQueue(ChangeQueue[QueuedChange]):
    """The node's directory changes awaiting a flush (see `ChangeQueue`)."""

    def put(
        self,
        change: Change,
        namespace: NamespaceId,
        scope: TenantId,
        hashes: Iterable[BlockHash],
        *,
        disk: bool = False,
    ) -> None:
        """Queue one change (of the disk set with ``disk``); on overflow drop everything
        and ask for a resync."""
        if self.needs_resync:
            return  # the resync snapshot will include it
        members = tuple(member(h, scope) for h in hashes)
        if members:
            self.append(QueuedChange(change, namespace, members, disk))


class Directory:
    """Reads and writes of this node's directory entries."""

    def __init__(self, keys: Keys, node_id: str, ttl_ms: int) -> None:
        self.keys = keys
        self.node_id = node_id
        self.ttl_ms = ttl_ms

    def write_changes(self, pipe: Any, changes: Sequence[QueuedChange]) -> None:
        """Queue the commands of ``changes`` on a pipeline (order kept per set)."""
        touched: set[str] = set()
        for item in changes:
            if item.disk:
                key = self.keys.ns_disk(item.namespace, self.node_id)
            else:
                key = self.keys.ns_node(item.namespace, self.node_id)
            if item.change is Change.ADD:
                pipe.sadd(key, *item.members)
                touched.add(key)
            else:
                pipe.srem(key, *item.members)
        for key in touched:
            # A set created between heartbeats still expires if we die now.
            pipe.pexpire(key, self.ttl_ms)

    def wipe(self, pipe: Any, namespaces: Iterable[str]) -> None:
        """Queue the removal of this node's entries in ``namespaces``."""
        for namespace in namespaces:
            pipe.delete(self.keys.ns_node(namespace, self.node_id))
            pipe.delete(self.keys.ns_disk(namespace, self.node_id))
            pipe.zrem(self.keys.ns_alive(namespace), self.node_id)
            pipe.hdel(self.keys.ns_addr(namespace), self.node_id)

    def write_snapshot(
        self,
        pipe: Any,
        snapshot: dict[NamespaceId, list[bytes]],
        chunk: int = 1000,
        *,
        disk: dict[NamespaceId, list[bytes]] | None = None,
    ) -> None:
        """Queue this node's full entry (after `wipe`): every READY block it holds, and
        every block on its disk tier (``disk``)."""
        sets = [(self.keys.ns_node(ns, self.node_id), ns, m) for ns, m in snapshot.items()]
        sets += [  # an empty disk set is no set: nothing to expire
            (self.keys.ns_disk(ns, self.node_id), ns, m) for ns, m in (disk or {}).items() if m
        ]
        for key, namespace, members in sets:
            for start in range(0, len(members), chunk):
                pipe.sadd(key, *members[start : start + chunk])
            pipe.pexpire(key, self.ttl_ms)
            pipe.sadd(self.keys.namespaces, namespace)

    async def heartbeat(self, client: Any, namespaces: Iterable[NamespaceId], address: str) -> None:
        """Refresh this node's liveness in every namespace it serves (one script each)."""
        for namespace in namespaces:
            keys = (
                self.keys.ns_alive(namespace),
                self.keys.ns_addr(namespace),
                self.keys.ns_node(namespace, self.node_id),
                self.keys.ns_engines(namespace),
                self.keys.ns_disk(namespace, self.node_id),
            )
            await NS_HEARTBEAT(client, keys, (self.node_id, address, self.ttl_ms))

    async def locate(
        self,
        client: Any,
        namespace: NamespaceId,
        scope: TenantId,
        chain: Sequence[BlockHash],
        *,
        skip_self: bool = True,
    ) -> list[PeerHolder]:
        """Live nodes holding a prefix of ``chain`` (longest first), in one round trip."""
        if not chain:
            return []
        keys = (self.keys.ns_alive(namespace), self.keys.ns_addr(namespace))
        args: list[str | bytes] = [
            self.keys.ns_node_prefix(namespace),
            self.node_id if skip_self else "",
            self.keys.ns_disk_prefix(namespace),
        ]
        args.extend(member(h, scope) for h in chain)
        reply = await LOCATE(client, keys, args)
        flat = reply[1]
        holders = [
            PeerHolder(_text(flat[i]), _text(flat[i + 1]), int(flat[i + 2]))
            for i in range(0, len(flat), 3)
        ]
        holders.sort(key=lambda h: (-h.blocks, h.node_id))
        return holders

    async def query(
        self, client: Any, namespace: NamespaceId, scope: TenantId, chain: Sequence[BlockHash]
    ) -> list[TierHolder]:
        """Every live holder (node pools and engines) of a prefix of ``chain``, longest first.

        One round trip (`QUERY`); this node counts like any other, as the
        directory has it (its last flush), so every node gives a router the
        same answer.
        """
        if not chain:
            return []
        tag = self.keys.ns_tag(namespace)
        keys = (self.keys.ns_alive(namespace), self.keys.ns_addr(namespace), f"{tag}:engines")
        args: list[str | bytes] = [
            self.keys.ns_node_prefix(namespace),
            f"{tag}:e:",
            self.keys.ns_disk_prefix(namespace),
        ]
        args.extend(member(h, scope) for h in chain)
        flat = (await QUERY(client, keys, args))[1]
        holders = [
            TierHolder(
                _text(flat[i]),
                _text(flat[i + 1]),
                int(flat[i + 2]),
                _text(flat[i + 3]),
                _text(flat[i + 4]),
            )
            for i in range(0, len(flat), 5)
        ]
        holders.sort(key=lambda h: (-h.blocks, h.node_id, h.engine))
        return holders


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
