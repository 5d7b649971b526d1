"""The cluster stream's entries (`service.cluster.event_stream`): fields and back, with tiers.

The pool's entries carry no ``tier`` field (as every node version writes them);
the disk tier's carry ``tier`` = ``disk``; a reader takes an entry without one
as the pool's.
"""

from __future__ import annotations

import pytest

from kvstore.api.wire import EVENT_TIER_DISK, EVENT_TIER_MEMORY, event_tier
from kvstore.events import CacheEvent, EventKind
from kvstore.types import BlockHash, NamespaceId, TenantId
from kvstore.v1 import kvstore_pb2 as pb
from service.cluster.event_stream import event_of, fields_of

H = [BlockHash(bytes([i]) * 32) for i in range(3)]
NS = NamespaceId("ns-1")
AT = 1_700_000_000.25


def stored(parent: BlockHash | None = H[0]) -> CacheEvent:
    return CacheEvent(EventKind.STORED, NS, TenantId("acme"), (H[1], H[2]), parent=parent)


def as_read(fields: dict[str, bytes]) -> dict[bytes, bytes]:
    """What XRANGE / XREAD hand back: byte keys."""
    return {k.encode(): v for k, v in fields.items()}


@pytest.mark.parametrize("tier", [EVENT_TIER_MEMORY, EVENT_TIER_DISK])
@pytest.mark.parametrize("kind", [EventKind.STORED, EventKind.REMOVED])
def test_a_block_event_round_trips_with_its_tier(kind: EventKind, tier: str) -> None:
    parent = H[0] if kind is EventKind.STORED else None
    ev = CacheEvent(kind, NS, TenantId("acme"), (H[1], H[2]), parent=parent)
    event = event_of(as_read(fields_of(ev, "node-a", AT, tier)))
    assert event is not None
    assert event.kind == (
        pb.EVENT_KIND_STORED if kind is EventKind.STORED else pb.EVENT_KIND_REMOVED
    )
    assert event.tier == tier
    assert list(event.hashes) == [H[1], H[2]]
    assert (event.namespace_id, event.tenant, event.node_id) == (NS, "acme", "node-a")
    assert event.at == AT
    assert event.parent == (H[0] if kind is EventKind.STORED else b"")


def test_the_pools_entries_are_unchanged_and_the_disks_say_disk() -> None:
    memory = fields_of(stored(), "node-a", AT)
    assert "tier" not in memory  # exactly what older nodes write
    assert set(memory) == {"kind", "node", "at", "ns", "tenant", "hashes", "parent"}
    disk = fields_of(stored(None), "node-a", AT, EVENT_TIER_DISK)
    assert disk["tier"] == b"disk" and "parent" not in disk
    assert {k: v for k, v in disk.items() if k != "tier"} == fields_of(stored(None), "node-a", AT)


def test_an_older_nodes_entry_reads_as_memory() -> None:
    old = {
        b"kind": b"removed",
        b"node": b"old-node",
        b"at": b"1.5",
        b"ns": b"ns-1",
        b"tenant": b"",
        b"hashes": H[0] + H[1],
    }
    event = event_of(old)
    assert event is not None and event.tier == EVENT_TIER_MEMORY
    cleared = event_of({b"kind": b"cleared", b"node": b"old-node", b"ns": b"ns-1"})
    assert cleared is not None and cleared.tier == EVENT_TIER_MEMORY


def test_node_events_have_no_tier() -> None:
    for kind in (b"node_joined", b"node_left"):
        event = event_of({b"kind": kind, b"node": b"node-a", b"at": b"2.0"})
        assert event is not None and event.tier == ""
    assert event_of({b"kind": b"something_new", b"tier": b"disk"}) is None


def test_event_tier_reads_an_empty_tier_on_a_block_event_as_memory() -> None:
    assert event_tier(pb.Event(kind=pb.EVENT_KIND_STORED)) == EVENT_TIER_MEMORY
    assert event_tier(pb.Event(kind=pb.EVENT_KIND_STORED, tier="disk")) == EVENT_TIER_DISK
    assert event_tier(pb.Event(kind=pb.EVENT_KIND_NODE_LEFT)) == ""
