"""Runs the store state machine (`tests.kvstore.store_machine`, whose docstring says what
it checks): random interleavings of every store operation from several leases."""

from __future__ import annotations

from hypothesis import settings

from tests.kvstore.store_machine import StoreMachine

StoreMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestStoreMachine = StoreMachine.TestCase
