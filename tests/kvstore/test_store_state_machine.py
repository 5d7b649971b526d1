"""Random interleavings of every store operation from several leases.

After every step the invariants of ``kvstore.block_table`` must hold; at the
end every lease expires and nothing may stay pinned or WRITING. Alice has a
quota (bob has none), so the per-scope LRUs and the quota path are exercised
against the same invariants, plus "resident blocks per tenant <= quota".

Quarantine (late writers, ``docs/leases.md``): the slots an expired lease was
writing are modelled with their release time; no reservation may hand one
out before it, a closed lease's slots are never quarantined, and
``free + quarantined + ready + writing == capacity`` after every step.
"""

from __future__ import annotations

from hypothesis import settings

from tests.kvstore.store_machine import StoreMachine

StoreMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestStoreMachine = StoreMachine.TestCase
