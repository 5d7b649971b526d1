"""OfferBook.end: only blocks still carrying the READY stamp they were offered with are intact."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvstore import Store
from kvstore.types import LeaseId, NamespaceId, SlotId
from service.cluster.nixl_agent import Place
from service.cluster.nixl_offers import OfferBook
from tests.kvstore.conftest import ALICE, NS, SPEC, chain, prompt


class _Agent:
    name = "holder"
    metadata_version = 1

    def metadata(self) -> bytes:
        return b"meta"

    def slot_address(self, namespace: NamespaceId, pool: Any, slot: SlotId) -> Place:
        return Place(arena=0, address=0x1000 + slot * 256)

    def progress(self) -> None:
        pass


class _Node:
    def __init__(self) -> None:
        self.config = SimpleNamespace(peer_fetch_timeout=5.0)
        self.store = Store()
        self.store.register_namespace(SPEC, capacity=8)
        self.t = 1.0

    def now(self) -> float:
        return self.t

    def pool(self, namespace: NamespaceId) -> Any:
        return SimpleNamespace(descriptor=SimpleNamespace(block_bytes=256))


def _write(store: Store, lease: int, hashes: list, now: float, commit: bool = True) -> None:
    store.open_lease(LeaseId(lease), ALICE, ttl=60.0, now=now)
    store.reserve(NS, ALICE, LeaseId(lease), hashes, now)
    if commit:
        store.commit(NS, ALICE, LeaseId(lease), hashes, now)


def _offer(book: OfferBook, hashes: list) -> int:
    answer = book.offer(NS, ALICE, hashes, 0, "", 0)
    assert len(answer.blocks) == len(hashes)
    return int(answer.offer_id)


def test_an_undisturbed_read_is_intact() -> None:
    node = _Node()
    hashes = chain(prompt(1, 1))
    _write(node.store, 1, hashes, 1.0)
    book = OfferBook(node, _Agent())  # type: ignore[arg-type]
    assert book.end(_offer(book, hashes)) == len(hashes)
    book.close()


def test_a_slot_rewritten_after_drop_and_register_again_is_not_intact() -> None:
    node = _Node()
    hashes = chain(prompt(1, 1))
    _write(node.store, 1, hashes, 1.0)
    book = OfferBook(node, _Agent())  # type: ignore[arg-type]
    during_write, during_commit = _offer(book, hashes), _offer(book, hashes)
    # During the READs: the namespace is dropped, registered again with the same
    # id, and the same chain is written into the same slots. Generations that
    # restarted at 0 and a check that took WRITING blocks counted this intact.
    node.store.drop_namespace(NS, 2.0, force=True)
    node.store.register_namespace(SPEC, capacity=8)
    _write(node.store, 2, hashes, 3.0, commit=False)
    assert book.end(during_write) == 0  # WRITING: the writer is copying over the READ
    node.store.commit(NS, ALICE, LeaseId(2), hashes, 4.0)
    assert book.end(during_commit) == 0  # READY again, but not the bytes that were read
    book.close()
