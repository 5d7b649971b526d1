"""The namespaces of one engine: a KV cache group's blocks, per rank or shared by all.

The connector keeps each KV cache group of a model in a namespace of its own
(`identity.KVGroup`: its kind, window and layout are part of the model id), and
with tensor parallelism each rank's share of a group in its own namespace too,
since each rank holds other KV heads. MLA is the exception: its latent vector
is the same on every rank, so one namespace holds it for all of them, saved by
rank 0 and loaded by every rank (the node holds one copy at any TP size).

A **unit** is one such namespace. The scheduler looks up and pins every unit
of a request; a worker loads the units that hold its rank's KV and saves the
ones it is the saver of. A model with one full-attention group keeps the model
id it had before groups existed, so its cached blocks stay valid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.client import Namespace
from kvstore.integrations.vllm.identity import KVGroup
from kvstore.integrations.vllm.node_link import NodeLink
from kvstore.integrations.vllm.paged import PagedLayer
from kvstore.layout import KVLayout


@dataclass(frozen=True, slots=True)
class Unit:
    """One namespace of an engine (see the module docstring)."""

    model_id: str
    group: KVGroup
    rank: int | None
    """The tensor-parallel rank whose KV it holds; None: every rank's (MLA)."""

    @property
    def saver(self) -> int:
        """The rank that saves this unit's blocks."""
        return self.rank if self.rank is not None else 0

    def loads_on(self, rank: int) -> bool:
        """Whether rank ``rank`` copies this unit's blocks into its cache on a hit."""
        return self.rank is None or self.rank == rank

    @property
    def loaders(self) -> frozenset[int] | None:
        """The ranks that load it (None: every rank)."""
        return None if self.rank is None else frozenset({self.rank})


def engine_units(groups: Sequence[KVGroup], model_id: str, tp: int) -> list[Unit]:
    """Every unit of an engine, group by group, rank by rank within a group.

    Args:
        groups: the engine's KV cache groups (`identity.kv_groups`).
        model_id: the namespace model id before its group and rank
            (`identity.namespace_model_id`).
        tp: the tensor-parallel size.
    """
    plain = len(groups) == 1 and groups[0].kind == "full"
    units: list[Unit] = []
    for group in groups:
        base = model_id if plain else model_id + group.tag
        if group.kind == "mla":
            units.append(Unit(base if tp == 1 else f"{base}#tp-{tp}", group, None))
        elif tp == 1:
            units.append(Unit(base, group, 0))
        else:
            units.extend(Unit(f"{base}#tp-{tp}.{rank}", group, rank) for rank in range(tp))
    return units


def default_units(link: NodeLink) -> list[Unit]:
    """The units of a link made without groups: one full-attention group, its model
    ids being ranks' in order (a test's, or an engine of one group)."""
    return [
        Unit(model_id, KVGroup(0, "full", layout, ()), rank)
        for rank, (model_id, layout) in enumerate(zip(link.model_ids, link.layouts, strict=True))
    ]


@dataclass(slots=True)
class UnitCopy:
    """What this worker copies for one unit (`units`): its layout, layers and namespace."""

    unit: int
    """The unit's index in the engine (`LoadSpec.unit`, `SaveSpec.unit`)."""
    ns_index: int
    """Its namespace's index in this worker's link."""
    layout: KVLayout
    layer_names: list[str]
    loads: bool = True
    """This rank copies the unit's blocks in on a hit."""
    saves: bool = True
    """This rank saves the unit's blocks (one rank per unit)."""
    layers: list[PagedLayer] = field(default_factory=list)
    """vLLM's paged tensors of the unit's layers (`register_kv_caches`)."""


def unit_copies(units: Sequence[Unit], rank: int) -> list[UnitCopy]:
    """The units rank ``rank`` loads or saves, in the order of its link's namespaces."""
    mine = [(i, u) for i, u in enumerate(units) if u.loads_on(rank) or u.saver == rank]
    return [
        UnitCopy(
            unit=i,
            ns_index=n,
            layout=u.group.layout,
            layer_names=list(u.group.layer_names),
            loads=u.loads_on(rank),
            saves=u.saver == rank,
        )
        for n, (i, u) in enumerate(mine)
    ]


def unit_namespace(link: NodeLink, copy: UnitCopy, wait: float = 0.0) -> Namespace | None:
    """The namespace of ``copy`` in a worker's ``link`` (None: not registered), waiting up
    to ``wait`` seconds for a registration in flight (only from threads that may block)."""
    namespaces = link.wait_namespaces(wait) if wait else link.namespaces()
    return namespaces[copy.ns_index] if namespaces is not None else None
