"""Topology: where this rank sits in the parallel grid; only ``(dp_rank, dp_size)`` selects data.

Four axes, each a rank and a size: ``dp`` (data parallel: selects the micro batches), ``cp`` (the
one axis a packed row is split over), ``tp`` (tensor parallel) and ``pp`` (pipeline parallel);
``cp``, ``tp`` and ``pp`` peers of a DP rank share its micro batches. The ``cp`` axis is stated
here once and taken from here by every stage:

    the plan       ``topology.bind(plan)``: the plan's ``cp_size`` is the topology's (the loader
                   binds its plan so; a plan left at ``cp_size=1`` takes it)
    the loader     reads rank ``cp_rank``'s windows of each micro batch
    the scorer     ``CPGroup.from_topology(topology, group=cp_pg)`` (``rollfeed.models``)

Rank order when built from a flat rank (``from_rank``): ``pp`` outermost, then ``dp``, ``cp``,
``tp`` innermost (torchtitan's mesh order, tensor parallel peers adjacent). Worked example::

    world 8, cp_size 2, tp_size 2 -> rank = (dp * 2 + cp) * 2 + tp
    Topology.from_rank(5, 8, cp_size=2, tp_size=2)
    -> Topology(dp_rank=1, dp_size=2, cp_rank=0, cp_size=2, tp_rank=1, tp_size=2, pp_rank=0,
                pp_size=1)                                   # world_size 8
    topology.bind(PlanConfig(seq_len=8, cp_layout="zigzag"))
    -> PlanConfig(seq_len=8, cp_size=2, cp_layout="zigzag")  # pad 4

From a ``DeviceMesh`` (``from_mesh``) the axes are read by name through the table of
:mod:`rollfeed.collate.mesh_axes` (``dp_replicate`` x ``dp_shard`` flatten into ``dp``, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rollfeed.collate.config import PlanConfig
from rollfeed.collate.errors import BatchConfigError
from rollfeed.collate.mesh_axes import read_mesh

AXES = ("dp", "cp", "tp", "pp")


def _size(name: str, size: object) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise BatchConfigError(f"{name} must be an int >= 1, got {size!r}")
    return size


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """Ranks and sizes per parallel axis; see the module doc. ``Topology()``: one process.

    Raises :class:`~rollfeed.collate.BatchConfigError` for a size < 1 or a rank outside
    ``[0, size)``, naming the axis.
    """

    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            rank = getattr(self, f"{axis}_rank")
            size = _size(f"{axis}_size", getattr(self, f"{axis}_size"))
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
                raise BatchConfigError(
                    f"{axis}_rank must be an int in [0, {axis}_size={size}), got {rank!r}"
                )

    @property
    def world_size(self) -> int:
        return self.dp_size * self.cp_size * self.tp_size * self.pp_size

    def bind(self, plan: PlanConfig) -> PlanConfig:
        """``plan`` for this rank's ``cp`` axis: its ``cp_size`` is this topology's.

        A plan left at ``cp_size=1`` takes the topology's (its pad and ``seq_len`` checked again
        for it); a plan that states another size than the topology's is refused
        (:class:`~rollfeed.collate.BatchConfigError`): rows are planned for the ``cp`` axis the
        trainer runs.
        """
        if plan.cp_size == self.cp_size:
            return plan
        if plan.cp_size != 1:
            raise BatchConfigError(
                f"topology.cp_size={self.cp_size} but plan.cp_size={plan.cp_size}: rows are "
                "planned for the cp axis the trainer runs; state it once, in the Topology, and "
                "leave PlanConfig.cp_size at its default"
            )
        return dataclasses.replace(plan, cp_size=self.cp_size)

    @classmethod
    def from_rank(
        cls, rank: int, world_size: int, *, cp_size: int = 1, tp_size: int = 1, pp_size: int = 1
    ) -> Topology:
        """Split a flat rank (order pp, dp, cp, tp; see the module doc)."""
        for name, size in (("cp_size", cp_size), ("tp_size", tp_size), ("pp_size", pp_size)):
            _size(name, size)
        inner = cp_size * tp_size * pp_size
        if world_size % inner:
            raise BatchConfigError(
                f"world_size={world_size} is not a multiple of cp_size*tp_size*pp_size={inner}; "
                "choose sizes whose product divides the world size"
            )
        if not 0 <= rank < world_size:
            raise BatchConfigError(f"rank must be in [0, world_size={world_size}), got {rank}")
        dp_size = world_size // inner
        tp, rest = rank % tp_size, rank // tp_size
        cp, rest = rest % cp_size, rest // cp_size
        dp, pp = rest % dp_size, rest // dp_size
        return cls(
            dp_rank=dp,
            dp_size=dp_size,
            cp_rank=cp,
            cp_size=cp_size,
            tp_rank=tp,
            tp_size=tp_size,
            pp_rank=pp,
            pp_size=pp_size,
        )

    @classmethod
    def from_process_group(
        cls, *, cp_size: int = 1, tp_size: int = 1, pp_size: int = 1, group: Any = None
    ) -> Topology:
        """From an initialised ``torch.distributed`` group (e.g. under torchrun) and sizes."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise BatchConfigError(
                "torch.distributed is not initialised; call init_process_group first or build "
                "Topology(...) / Topology.from_rank(...) directly"
            )
        return cls.from_rank(
            dist.get_rank(group),
            dist.get_world_size(group),
            cp_size=cp_size,
            tp_size=tp_size,
            pp_size=pp_size,
        )

    @classmethod
    def from_mesh(cls, mesh: Any) -> Topology:
        """From a ``DeviceMesh`` with named dimensions, read through the axis table of
        :mod:`rollfeed.collate.mesh_axes`: the data axes (``dp``, ``dp_replicate``, ``dp_shard``,
        ``fsdp``, ``ddp``) flatten in mesh order into ``dp``; ``cp``, ``tp``, ``pp`` are read as
        they are; an axis the mesh lacks has size 1. Unknown or ambiguous names, and ``ep`` as a
        dimension of its own, raise :class:`~rollfeed.collate.MeshAxisError` naming the axis::

            names = ("dp_replicate", "dp_shard", "cp")
            mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
            Topology.from_mesh(mesh)   # rank 5 -> dp_rank=2, dp_size=4, cp_rank=1, cp_size=2
        """
        return cls(**read_mesh(mesh))
