"""The connector's request life: every move the table allows works, every other is refused."""

from __future__ import annotations

import pytest

from kvstore.integrations.vllm.request_life import (
    IN_FLIGHT,
    MOVES,
    PINNED,
    IllegalMove,
    Phase,
    RequestLife,
)


def at(phase: Phase) -> RequestLife:
    """A life in ``phase``, reached through allowed moves only (a path from NEW)."""
    paths = {
        Phase.NEW: [],
        Phase.LOOKING_UP: [Phase.LOOKING_UP],
        Phase.HIT: [Phase.LOOKING_UP, Phase.HIT],
        Phase.LOAD_PLANNED: [Phase.LOOKING_UP, Phase.HIT, Phase.LOAD_PLANNED],
        Phase.LOADING: [Phase.LOOKING_UP, Phase.HIT, Phase.LOAD_PLANNED, Phase.LOADING],
        Phase.RUNNING: [Phase.RUNNING],
        Phase.DRAINING: [
            Phase.LOOKING_UP,
            Phase.HIT,
            Phase.LOAD_PLANNED,
            Phase.LOADING,
            Phase.DRAINING,
        ],
        Phase.DONE: [Phase.DONE],
    }
    life = RequestLife()
    for step in paths[phase]:
        life.move(step)
    assert life.phase is phase
    return life


def test_every_phase_is_reachable_and_in_the_table() -> None:
    assert set(MOVES) == set(Phase)
    for phase in Phase:
        at(phase)


@pytest.mark.parametrize("origin", list(Phase))
@pytest.mark.parametrize("target", list(Phase))
def test_a_move_is_allowed_exactly_when_the_table_lists_it(origin: Phase, target: Phase) -> None:
    life = at(origin)
    if target in MOVES[origin]:
        life.move(target)
        assert life.phase is target
    else:
        with pytest.raises(IllegalMove, match=f"{origin.name} to {target.name}"):
            life.move(target)
        assert life.phase is origin


def test_a_load_in_flight_never_ends_without_draining() -> None:
    """Pins a worker may be copying from are never dropped by the request's end: LOADING
    only runs on (every rank reported) or drains (vLLM is done with the request)."""
    for phase in IN_FLIGHT:
        assert Phase.DONE not in MOVES[phase] or phase is Phase.DRAINING
    assert MOVES[Phase.LOADING] == {Phase.RUNNING, Phase.DRAINING}
    assert MOVES[Phase.LOAD_PLANNED] == {Phase.LOADING, Phase.DRAINING}
    assert IN_FLIGHT <= PINNED
    assert at(Phase.LOADING).in_flight and at(Phase.HIT).pinned
    assert not at(Phase.RUNNING).pinned and not at(Phase.HIT).in_flight


def test_done_is_final() -> None:
    assert MOVES[Phase.DONE] == frozenset()
