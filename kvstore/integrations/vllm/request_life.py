"""One request's life in the connector's scheduler side, as one state machine.

Every phase a request goes through, and every move between phases, is here
and nowhere else: `RequestLife.move` refuses a move the table does not list
(a bug, raised as `IllegalMove`), so a path that would drop a pin while a
copy is in flight has to be written into `MOVES` first, where a reviewer
sees it and the tests walk it (tests/integrations/vllm/test_request_life.py).

    NEW ──lookup sent──► LOOKING_UP ──hit pinned──► HIT ──vLLM took it──► LOAD_PLANNED
     │                       │                       │                        │ sent with
     │                       │ miss, failure,        │ vLLM did not           │ the step
     │ nothing to look up    │ timeout               │ take it                ▼
     └──────────────────────►┴──────────────────────►┴──────► RUNNING ◄── LOADING
                                                                 │  every    │ vLLM done with it
                                                                 │  rank     ▼ (finished, aborted)
                                                                 │  reported DRAINING
                                                                 ▼           │ every rank reported
                                                                DONE ◄───────┘

- A request's pins are held in HIT (not yet taken), LOAD_PLANNED (taken, not
  yet sent) and LOADING/DRAINING (sent: the workers copy them). In LOADING and
  DRAINING each rank's pins are released only when *that rank* reported its
  load finished; vLLM reports the ranks of one step together but not the
  ranks of different steps, and one rank's report says nothing of another's.
- vLLM may finish (abort) a request whose load is in flight: it goes to
  DRAINING, never DONE, until every rank reported.
- A planned load is always sent (vLLM waits for its report): a request finished
  in LOAD_PLANNED drains like one finished in LOADING.
- Every other phase may go to DONE: what it pins was never handed to a worker
  and is released at once.
"""

from __future__ import annotations

import concurrent.futures
import enum
from dataclasses import dataclass, field
from typing import Any

from kvstore.client import Hit
from kvstore.integrations.vllm.metadata import LoadSpec
from kvstore.types import BlockHash


class Phase(enum.Enum):
    """Where a request is in the connector's life."""

    NEW = "new"
    """Tracked (its chain hashed); no lookup sent yet."""
    LOOKING_UP = "looking_up"
    """A pinned Lookup per rank is in flight."""
    HIT = "hit"
    """Every rank's hit is pinned; vLLM has not allocated the request's blocks yet."""
    LOAD_PLANNED = "load_planned"
    """vLLM took the hit: the loads go to the workers with the next step."""
    LOADING = "loading"
    """The loads were sent; some rank has not reported its load finished yet."""
    RUNNING = "running"
    """Nothing to load (or loaded by every rank): vLLM computes; the connector saves."""
    DRAINING = "draining"
    """vLLM is done with the request while its load is in flight: kept only to release each
    rank's pins as it reports."""
    DONE = "done"
    """Forgotten: nothing pinned, nothing in flight."""


MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.NEW: frozenset({Phase.LOOKING_UP, Phase.RUNNING, Phase.DONE}),
    Phase.LOOKING_UP: frozenset({Phase.HIT, Phase.RUNNING, Phase.DONE}),
    Phase.HIT: frozenset({Phase.LOAD_PLANNED, Phase.RUNNING, Phase.DONE}),
    Phase.LOAD_PLANNED: frozenset({Phase.LOADING, Phase.DRAINING}),
    Phase.LOADING: frozenset({Phase.RUNNING, Phase.DRAINING}),
    Phase.RUNNING: frozenset({Phase.DONE}),
    Phase.DRAINING: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}
"""Every allowed move: from a phase to the phases it may go to next."""

PINNED = frozenset({Phase.HIT, Phase.LOAD_PLANNED, Phase.LOADING, Phase.DRAINING})
"""Phases in which the request holds pins on the node."""

IN_FLIGHT = frozenset({Phase.LOADING, Phase.DRAINING})
"""Phases in which a worker may be copying the request's pinned slots."""


class IllegalMove(RuntimeError):
    """A move the table does not allow: a bug in the connector, never a user error."""


class RequestLife:
    """The phase of one request, moved only through `move`."""

    __slots__ = ("phase",)

    def __init__(self) -> None:
        self.phase = Phase.NEW

    def move(self, to: Phase) -> None:
        """Go to phase ``to``.

        Raises:
            IllegalMove: ``MOVES`` has no move from the current phase to ``to``.
        """
        if to not in MOVES[self.phase]:
            raise IllegalMove(f"bug: a request cannot go from {self.phase.name} to {to.name}")
        self.phase = to

    @property
    def pinned(self) -> bool:
        """Whether the request holds pins on the node."""
        return self.phase in PINNED

    @property
    def in_flight(self) -> bool:
        """Whether a worker may be copying the request's pinned slots."""
        return self.phase in IN_FLIGHT

    def __repr__(self) -> str:
        return f"RequestLife({self.phase.name})"


@dataclass(slots=True)
class TrackedRequest:
    """What the scheduler side knows about one request (its phase: `life`)."""

    request: Any
    """vLLM's request: its ``all_token_ids`` grow as it decodes."""
    chains: list[list[BlockHash]]
    """Per unit (its own namespace, its own chain root): chain hashes of
    the request's full blocks hashed so far (the tokens known at the first ask, then the
    output's as blocks are saved)."""
    prompt_blocks: int
    """Full blocks of the prompt (the save limit without ``save_decode``)."""
    asked_at: float
    """When vLLM first asked for this admission (the lookup's time budget starts)."""
    life: RequestLife = field(default_factory=RequestLife)
    """The request's phase (`request_life`): the only place it changes."""
    lookup: concurrent.futures.Future[list[Hit]] | None = None
    """LOOKING_UP: the Lookups in flight (one per rank, answered together)."""
    hits: list[Hit] | None = None
    """HIT to DRAINING: the pinned hits (one per unit: `units`); a unit's is released once
    every rank that copies it reported its load."""
    loads: list[LoadSpec] = field(default_factory=list)
    """LOAD_PLANNED: the loads to send with the next step (one per unit)."""
    pending: set[tuple[int, int]] = field(default_factory=set)
    """LOADING, DRAINING: (unit, rank) whose copy that rank has not reported finished."""
    local_tokens: int = 0
    """vLLM's (block-aligned) local hit when the hit was counted."""
    block_ids: list[list[int]] = field(default_factory=list)
    """vLLM block ids of the request, per KV cache group, as allocated so far (a sliding
    window's blocks that vLLM freed are its null block, 0)."""
    saved_blocks: int = 0
    """Leading full blocks the node is known to have for every rank (at lookup, or
    confirmed commits): saving starts after them."""
    saved_by_unit: dict[int, int] = field(default_factory=dict)
    """Confirmed commits per unit (the workers report them in different steps)."""
    planned_blocks: int = 0
    """Leading full blocks saved or planned for saving."""
    poisoned: bool = False
    """Never save this request (its blocks touched a failed load's)."""
    corrupt: dict[int, set[int]] = field(default_factory=dict)
    """LOADING, DRAINING: per unit, pool slots a worker found corrupt (reported with the
    unit's release)."""
