"""Store.drop_namespace: refused while in use unless forced; leases live on; re-register works."""

from __future__ import annotations

import pytest

from kvstore import EventKind, FailedPrecondition, Store, StoreLimits, UnknownNamespace
from tests.kvstore.conftest import ALICE, NS, SPEC, Runner, chain, prompt


def test_drop_refused_while_pinned_or_writing_then_forced() -> None:
    store = Store(StoreLimits())
    store.register_namespace(SPEC, capacity=16)
    a, b = Runner(store, 1), Runner(store, 2)
    stored = chain(prompt(1, 1))
    a.store_chain(stored)
    a.hits(stored, pin=True)
    store.reserve(NS, ALICE, b.lease, chain(prompt(2, 2))[3:], 1.0)  # 2 WRITING under b
    store.take_events()
    with pytest.raises(FailedPrecondition, match="5 pinned and 2 WRITING"):
        store.drop_namespace(NS, 3.0, force=False)
    assert store.table(NS).stats().ready == 5  # nothing changed

    report = store.drop_namespace(NS, 3.0, force=True)
    assert (report.removed, report.pins_dropped, report.writes_aborted) == (7, 5, 2)
    kinds = [e.kind for e in store.take_events()]
    assert kinds[-1] is EventKind.CLEARED and EventKind.REMOVED in kinds
    with pytest.raises(UnknownNamespace):
        store.table(NS)
    stats = store.stats()
    assert stats.namespaces == () and stats.pinned_by_leases == 0 and stats.writing_by_leases == 0
    assert stats.leases == 2  # the leases live on, without what they held there

    store.register_namespace(SPEC, capacity=8)  # the same layout registers again
    assert store.table(NS).capacity == 8 and a.store_chain(stored) == 5


def test_drop_of_an_idle_namespace_needs_no_force() -> None:
    store = Store(StoreLimits())
    store.register_namespace(SPEC, capacity=4)
    Runner(store, 1).store_chain(chain(prompt(1, 1))[:3])
    assert store.drop_namespace(NS, 2.0, force=False).removed == 3
    with pytest.raises(UnknownNamespace):
        store.drop_namespace(NS, 2.0, force=False)
