"""Key design for Redis Cluster: every script's keys share one hash slot."""

from __future__ import annotations

from redis.crc import key_slot as redis_slot

from service.cluster.keys import Keys, key_slot, member, split_member


def test_slot_function_matches_redis_py():
    for key in ("foo", "{user1000}.following", "a{}b", "{kvstore:ns}:n:x", "{}{x}"):
        assert key_slot(key) == redis_slot(key.encode())


def test_registry_keys_share_a_slot():
    keys = Keys("kvstore")
    slots = {key_slot(k) for k in (keys.nodes, keys.alive, keys.events, keys.namespaces)}
    assert len(slots) == 1


def test_namespace_keys_share_a_slot_and_spread_over_namespaces():
    keys = Keys("kvstore")
    for ns in ("0123456789abcdef", "fedcba9876543210"):
        slots = {
            key_slot(k)
            for k in (keys.ns_alive(ns), keys.ns_addr(ns), keys.ns_node(ns, "node-1"),
                      keys.ns_node(ns, "node:with:colons"))
        }  # fmt: skip
        assert len(slots) == 1
    namespaces = {key_slot(Keys("kvstore").ns_alive(f"{i:016x}")) for i in range(64)}
    assert len(namespaces) > 32


def test_member_round_trips_hash_and_scope():
    h = bytes(range(32))
    assert split_member(member(h, "acme")) == (h, "acme")
    assert split_member(member(h, "")) == (h, "")
