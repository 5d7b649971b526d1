"""The classic prefix-caching cases, on the core store."""

from __future__ import annotations

from kvstore import KVLayout, NamespaceSpec, Store
from tests.kvstore.conftest import BOB, NS, SPEC, Runner, chain, prompt


def test_same_system_prompt_reuses_its_full_blocks(store: Store) -> None:
    a = Runner(store, 1)
    first = chain(prompt(system=1, user=1))
    assert a.store_chain(first) == 5
    second = chain(prompt(system=1, user=2))
    # The three system-prompt blocks hit; the user blocks differ.
    assert a.hits(second) == 3
    assert first[:3] == second[:3]
    # Storing the second request writes only its two user blocks.
    assert a.store_chain(second) == 2


def test_different_system_prompts_share_nothing_after_first_difference(store: Store) -> None:
    a = Runner(store, 1)
    sys1 = prompt(system=1, user=7)
    sys2 = prompt(system=2, user=7)  # identical user blocks after another system prompt
    assert sys1[12:] == sys2[12:]
    a.store_chain(chain(sys1))
    assert a.hits(chain(sys2)) == 0
    assert set(chain(sys1)).isdisjoint(chain(sys2))


def test_difference_inside_a_block_shares_the_blocks_before_it(store: Store) -> None:
    a = Runner(store, 1)
    base = prompt(system=1, user=1)
    other = list(base)
    other[6] += 1  # inside block 1
    a.store_chain(chain(base))
    assert a.hits(chain(other)) == 1


def test_switching_system_prompt_keeps_old_blocks_until_pressure() -> None:
    store = Store()
    store.register_namespace(SPEC, capacity=10)
    a = Runner(store, 1)
    old = chain(prompt(system=1, user=1))
    a.store_chain(old, now=1.0)
    new = chain(prompt(system=2, user=1))
    a.store_chain(new, now=2.0)
    # Not erased: the old system prompt is still fully cached.
    assert a.hits(old, now=3.0) == 5
    # Under pressure, LRU evicts the least recently used chain first: touch
    # the old one, then store a third prompt that needs 5 slots.
    a.hits(old, now=4.0)
    third = chain(prompt(system=3, user=1))
    assert a.store_chain(third, now=5.0) == 5
    assert a.hits(new, now=6.0) == 0
    assert a.hits(old, now=6.0) == 5


def test_several_system_prompts_coexist(store: Store) -> None:
    a = Runner(store, 1)
    for system in range(4):
        for user in range(2):
            a.store_chain(chain(prompt(system, user)))
    for system in range(4):
        for user in range(3):
            expected = 5 if user < 2 else 3
            assert a.hits(chain(prompt(system, user))) == expected


def test_tenants_never_share_blocks(store: Store) -> None:
    alice = Runner(store, 1)
    bob = Runner(store, 2, tenant=BOB)
    tokens = prompt(system=1, user=1)
    alice.store_chain(chain(tokens))
    # Same tokens, same hashes even (a client that guessed them): bob misses.
    assert bob.hits(chain(tokens)) == 0
    assert bob.hits(chain(tokens, salt=b"bob-salt")) == 0
    # Bob stores his own copy; both are resident side by side.
    assert bob.store_chain(chain(tokens)) == 5
    stats = store.stats().namespaces[0]
    assert stats.resident_by_tenant == {"alice": 5, "bob": 5}


def test_shared_namespace_shares_across_tenants() -> None:
    store = Store()
    store.register_namespace(SPEC, capacity=16, shared=True)
    alice, bob = Runner(store, 1), Runner(store, 2, tenant=BOB)
    tokens = chain(prompt(system=1, user=1), salt=b"")
    alice.store_chain(tokens)
    assert bob.hits(tokens) == 5


def test_other_layout_is_another_namespace() -> None:
    store = Store()
    store.register_namespace(SPEC, capacity=8)
    other = NamespaceSpec("other-model", KVLayout(4, 2, 8, 4, "float16"))
    table = store.register_namespace(other, capacity=8)
    assert table.namespace != NS
