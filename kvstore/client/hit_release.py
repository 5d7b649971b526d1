"""The release of one hit's pins: where it is, and the id that names the pins.

A `Hit` is the lookup's answer (data); its `HitRelease` is what `Client.release`
moves along, in one place:

    HELD --begin--> RELEASING --answered--> ANSWERED
      |                                        ^
      +------------------ answered ------------+   (nothing to send: unpinned,
                                                    a miss, or the lease is gone)

``HELD``: views work (if the hit is pinned). ``RELEASING``: release was called,
so no new views, but the node has not answered yet: a further release (after
a failure or a timeout) sends it again under the same ``release_id``, which
the node applies once. ``ANSWERED``: the pins are gone; a further release
sends nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["HitRelease", "ReleaseState"]


class ReleaseState(enum.Enum):
    """Where the release of a hit's pins is."""

    HELD = "held"
    """Not released: the pins (if any) hold the slots."""
    RELEASING = "releasing"
    """Release called, not yet answered by the node: no new views; may be sent again."""
    ANSWERED = "answered"
    """The node answered (or there was nothing to release): a further release sends nothing."""


_MOVES: dict[ReleaseState, frozenset[ReleaseState]] = {
    ReleaseState.HELD: frozenset({ReleaseState.RELEASING, ReleaseState.ANSWERED}),
    ReleaseState.RELEASING: frozenset({ReleaseState.RELEASING, ReleaseState.ANSWERED}),
    ReleaseState.ANSWERED: frozenset({ReleaseState.ANSWERED}),
}
"""The moves `HitRelease` makes; anything else is a bug."""


@dataclass(slots=True)
class HitRelease:
    """The release of one hit's pins (owned by the hit, moved by `Client.release`)."""

    release_id: int = 0
    """The id that names this hit's pins, chosen by `Client.lookup` and sent with the
    pinned Lookup (``LookupRequest.release_id``; 0 when not pinned, or for a hit not
    made by `Client.lookup`): every release attempt sends it, so the node drops exactly
    the pins that lookup took, once, however often and however late it is sent."""
    state: ReleaseState = ReleaseState.HELD
    """Where the release is (see the module docstring)."""

    @property
    def released(self) -> bool:
        """True once release was called: no views from then on."""
        return self.state is not ReleaseState.HELD

    @property
    def answered(self) -> bool:
        """True once nothing is left to send."""
        return self.state is ReleaseState.ANSWERED

    def begin(self) -> None:
        """Release is being sent (first time or again): no new views from here on."""
        self._move(ReleaseState.RELEASING)

    def settle(self) -> None:
        """The node answered, or there is nothing to release: nothing more to send."""
        self._move(ReleaseState.ANSWERED)

    def _move(self, to: ReleaseState) -> None:
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"bug: a hit's release cannot move from {self.state} to {to}")
        self.state = to
