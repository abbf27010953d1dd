"""Topology: where this rank sits in the parallel grid; only ``(dp_rank, dp_size)`` selects data.

Three axes: ``dp`` (data parallel: selects the micro batches), ``cp`` (the one axis a packed row
is split over: the planner pads for ``cp_size``, the loader reads rank ``cp_rank``'s windows, the
scorer runs Ulysses over the ``cp`` group) and ``tp`` (tensor parallel: shares the data). Rank
order when built from a flat rank (``from_rank``): ``dp`` outermost, then ``cp``, ``tp``
innermost (the mesh order of torchtitan-style trainers, tensor parallel peers adjacent)::

    world 8, cp_size 2, tp_size 2 -> rank = (dp * 2 + cp) * 2 + tp
    rank 5 -> Topology(dp_rank=1, dp_size=2, cp_rank=0, cp_size=2, tp_rank=1, tp_size=2)

The scorer's ``cp`` group takes the same coordinates:
``CPGroup(group=cp_pg, rank=topo.cp_rank, size=topo.cp_size)`` (``rollfeed.models``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollfeed.loaders.errors import LoaderConfigError

_DIMS = ("dp", "cp", "tp")


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """Ranks and sizes per parallel axis (``dp``, ``cp``, ``tp``); the ``cp`` and ``tp`` peers of
    a DP rank get the same micro batches, each ``cp`` rank its own windows of them."""

    dp_rank: int
    dp_size: int
    cp_rank: int = 0
    cp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1

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
        return self.dp_size * self.cp_size * self.tp_size

    @classmethod
    def from_rank(
        cls, rank: int, world_size: int, *, cp_size: int = 1, tp_size: int = 1
    ) -> Topology:
        """Split a flat rank (order dp, cp, tp; see module doc)."""
        for name, size in (("cp_size", cp_size), ("tp_size", tp_size)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise LoaderConfigError(f"{name} must be an int >= 1, got {size!r}")
        inner = cp_size * tp_size
        if world_size % inner:
            raise LoaderConfigError(
                f"world_size={world_size} is not a multiple of cp_size*tp_size={inner}; "
                "choose sizes whose product divides the world size"
            )
        if not 0 <= rank < world_size:
            raise LoaderConfigError(f"rank must be in [0, world_size={world_size}), got {rank}")
        tp, rest = rank % tp_size, rank // tp_size
        cp, dp = rest % cp_size, rest // cp_size
        return cls(
            dp_rank=dp,
            dp_size=world_size // inner,
            cp_rank=cp,
            cp_size=cp_size,
            tp_rank=tp,
            tp_size=tp_size,
        )

    @classmethod
    def from_process_group(
        cls, *, cp_size: int = 1, tp_size: int = 1, group: Any = None
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
        )

    @classmethod
    def from_mesh(cls, mesh: Any) -> Topology:
        """From a ``DeviceMesh`` whose dimension names include ``dp`` (and any of cp, tp).

        A dimension the mesh lacks has size 1; names other than these three are not allowed,
        since a rank of an unknown dimension may or may not need its own data.
        """
        names = tuple(mesh.mesh_dim_names or ())
        unknown = [n for n in names if n not in _DIMS]
        if "dp" not in names or unknown:
            raise LoaderConfigError(
                f"mesh dimension names {names} must include 'dp' and only use {_DIMS}; "
                "flatten other dimensions into one of these"
            )
        kw: dict[str, int] = {}
        for dim in names:
            kw[f"{dim}_rank"] = mesh.get_local_rank(dim)
            kw[f"{dim}_size"] = mesh.size(names.index(dim))
        return cls(**kw)
