"""A hit's release (`HitRelease`): its states and the moves between them."""

from __future__ import annotations

import pytest

from kvstore.client.hit_release import HitRelease, ReleaseState

HELD, RELEASING, ANSWERED = ReleaseState.HELD, ReleaseState.RELEASING, ReleaseState.ANSWERED


@pytest.mark.parametrize(
    ("start", "move", "end"),
    [
        (HELD, "begin", RELEASING),
        (HELD, "settle", ANSWERED),  # nothing to send: unpinned, a miss, a lost lease
        (RELEASING, "begin", RELEASING),  # sent again after a failure or a timeout
        (RELEASING, "settle", ANSWERED),
        (ANSWERED, "settle", ANSWERED),
        (ANSWERED, "begin", None),  # answered: nothing is ever sent again
    ],
)
def test_the_moves_table(start: ReleaseState, move: str, end: ReleaseState | None) -> None:
    release = HitRelease(7, start)
    if end is None:
        with pytest.raises(RuntimeError, match="bug"):
            getattr(release, move)()
        assert release.state is start
    else:
        getattr(release, move)()
        assert release.state is end
    assert release.release_id == 7


def test_released_and_answered_follow_the_state() -> None:
    release = HitRelease()
    assert (release.released, release.answered) == (False, False)
    release.begin()
    assert (release.released, release.answered) == (True, False)
    release.settle()
    assert (release.released, release.answered) == (True, True)
