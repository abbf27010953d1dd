"""CPGroup: this rank's place on the ``cp`` axis, the one axis a packed row is split over.

The ``cp`` axis is stated once, in the :class:`~rollfeed.collate.Topology`: the planner pads rows
for its ``cp_size`` ranks, the loader reads rank ``cp_rank``'s windows, and the scorer runs
Ulysses attention over the same ranks, taking rank and size from it::

    topo = Topology.from_process_group(cp_size=2)          # rank order dp, cp, tp
    cp = CPGroup.from_topology(topo, group=cp_pg)          # rank topo.cp_rank of topo.cp_size
    scorer = PolicyScorer(model, cp=cp)

or from the trainer's ``DeviceMesh``: ``CPGroup.from_mesh(mesh)`` (``PolicyScorer.from_mesh``),
which is ``from_topology(Topology.from_mesh(mesh), group=mesh.get_group("cp"))``.

``cp_pg`` is the process group of this rank's ``cp`` peers (``mesh.get_group("cp")``, or one
``dist.new_group`` per DP x TP coordinate). On an initialised ``torch.distributed`` the given rank
and size are checked against the group's own, so a group built in another rank order than the
topology is refused here rather than scoring another rank's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from rollfeed.collate import Topology
from rollfeed.models.errors import CPGroupError


@dataclass(frozen=True, kw_only=True, slots=True)
class CPGroup:
    """The ``cp`` process group of this rank, its rank in it and its size.

    ``CPGroup()`` (no group, rank 0, size 1): the whole row is local, no collective runs.
    Raises :class:`~rollfeed.models.CPGroupError` for a rank outside ``[0, size)``, a size > 1
    without a group, or a rank and size that are not the process group's own.
    """

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        for name in ("rank", "size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise CPGroupError(f"CPGroup.{name} must be an int, got {value!r}")
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise CPGroupError(
                f"CPGroup needs size >= 1 and 0 <= rank < size, got rank={self.rank}, "
                f"size={self.size}; build it with CPGroup.from_topology(topology, group=cp_pg)"
            )
        if self.size > 1 and self.group is None:
            raise CPGroupError(
                f"CPGroup size={self.size} needs the process group of this rank's cp peers"
            )
        if isinstance(self.group, dist.ProcessGroup) and dist.is_initialized():
            own = (dist.get_rank(self.group), dist.get_world_size(self.group))
            if own != (self.rank, self.size):
                raise CPGroupError(
                    f"CPGroup rank {self.rank} of {self.size} disagrees with its process group, "
                    f"where this process is rank {own[0]} of {own[1]}; build the cp groups from "
                    "the same rank order as the Topology (dp, cp, tp; tp innermost) or from the "
                    "DeviceMesh the Topology was read from"
                )

    @classmethod
    def from_topology(cls, topology: Topology, *, group: dist.ProcessGroup | None) -> CPGroup:
        """This rank's ``cp`` coordinate of ``topology`` over ``group``, the process group of its
        ``cp`` peers (``None`` allowed, and ignored, when ``topology.cp_size == 1``)::

            CPGroup.from_topology(Topology(dp_size=2, cp_rank=1, cp_size=2), group=cp_pg)
            -> CPGroup(group=cp_pg, rank=1, size=2)
        """
        if topology.cp_size == 1:
            return cls()
        return cls(group=group, rank=topology.cp_rank, size=topology.cp_size)

    @classmethod
    def from_mesh(cls, mesh: Any) -> CPGroup:
        """The ``cp`` dimension of a named ``DeviceMesh``, read through
        :meth:`Topology.from_mesh <rollfeed.collate.Topology.from_mesh>`; ``CPGroup()`` when the
        mesh has no ``cp`` dimension."""
        topology = Topology.from_mesh(mesh)
        group = mesh.get_group("cp") if topology.cp_size > 1 else None
        return cls.from_topology(topology, group=group)

    @property
    def enabled(self) -> bool:
        """True when the row is split over more than one rank (collectives run)."""
        return self.size > 1
