"""Topology: where this rank sits in the parallel grid; only ``(dp_rank, dp_size)`` selects data.

Four axes: ``dp`` (data parallel: selects the micro batches), ``cp`` (the one axis a packed row is
split over: the planner pads for ``cp_size``, the loader reads rank ``cp_rank``'s windows, the
scorer runs Ulysses over the ``cp`` group), ``tp`` (tensor parallel) and ``pp`` (pipeline
parallel), which share the data. Rank order when built from a flat rank (``from_rank``): ``pp``
outermost, then ``dp``, ``cp``, ``tp`` innermost (torchtitan's mesh order, tensor parallel peers
adjacent)::

    world 8, cp_size 2, tp_size 2 -> rank = (dp * 2 + cp) * 2 + tp
    rank 5 -> Topology(dp_rank=1, dp_size=2, cp_rank=0, cp_size=2, tp_rank=1, tp_size=2)

From a ``DeviceMesh`` (``from_mesh``) the axes are read by name through the table of
:mod:`rollfeed.collate.mesh_axes` (``dp_replicate`` x ``dp_shard`` flatten into ``dp``, ...).
The scorer's ``cp`` group takes the same coordinates:
``CPGroup(group=cp_pg, rank=topo.cp_rank, size=topo.cp_size)`` or ``CPGroup.from_mesh(mesh)``
(``rollfeed.models``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rollfeed.collate.mesh_axes import read_mesh
from rollfeed.loaders.errors import LoaderConfigError

_DIMS = ("dp", "cp", "tp", "pp")


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """Ranks and sizes per parallel axis (``dp``, ``cp``, ``tp``, ``pp``); the ``cp``, ``tp`` and
    ``pp`` peers of a DP rank get the same micro batches, each ``cp`` rank its own windows."""

    dp_rank: int
    dp_size: int
    cp_rank: int = 0
    cp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        for dim in _DIMS:
            rank, size = getattr(self, f"{dim}_rank"), getattr(self, f"{dim}_size")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise LoaderConfigError(f"{dim}_size must be an int >= 1, got {size!r}")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
                raise LoaderConfigError(
                    f"{dim}_rank must be an int in [0, {dim}_size={size}), got {rank!r}"
                )

    @property
    def world_size(self) -> int:
        return self.dp_size * self.cp_size * self.tp_size * self.pp_size

    @classmethod
    def from_rank(
        cls, rank: int, world_size: int, *, cp_size: int = 1, tp_size: int = 1, pp_size: int = 1
    ) -> Topology:
        """Split a flat rank (order pp, dp, cp, tp; see module doc)."""
        sizes = (("cp_size", cp_size), ("tp_size", tp_size), ("pp_size", pp_size))
        for name, size in sizes:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise LoaderConfigError(f"{name} must be an int >= 1, got {size!r}")
        inner = cp_size * tp_size * pp_size
        if world_size % inner:
            raise LoaderConfigError(
                f"world_size={world_size} is not a multiple of cp_size*tp_size*pp_size={inner}; "
                "choose sizes whose product divides the world size"
            )
        if not 0 <= rank < world_size:
            raise LoaderConfigError(f"rank must be in [0, world_size={world_size}), got {rank}")
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
            raise LoaderConfigError(
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
        return cls(**asdict(read_mesh(mesh)))
