"""The mesh axis table: which ``DeviceMesh`` dimensions select data and which share it.

A trainer describes its grid with a ``DeviceMesh`` whose dimensions carry names (torchtitan's:
``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``). Only the *data* axes choose which micro
batches a rank gets; the peers along a *sharing* axis get the same micro batches (``cp`` peers
each read their own windows of them). :class:`~rollfeed.collate.Topology` reads a mesh through
this one table (and the scorer's ``CPGroup.from_mesh`` through the Topology):

    data axes     dp, dp_replicate, dp_shard, fsdp, ddp   flattened in mesh order: dp_rank/size
    sharing axes  cp (the row is split over it), tp, pp   one coordinate each
    ep            only as a flattened view of other axes (torchtitan carves it from dp_shard x cp);
                  as a dimension of its own it would be a coordinate whose data needs are unknown

Names outside the table, ``ep`` as a real dimension, and synonyms together (``dp`` with any other
data axis, ``dp_shard`` with ``fsdp``, ``dp_replicate`` with ``ddp``) raise :class:`MeshAxisError`.

Worked example, mesh ``("pp", "dp_replicate", "dp_shard", "cp", "tp")`` of shape
``(1, 2, 2, 2, 1)``, this rank at local ranks ``(0, 1, 0, 1, 0)``::

    mesh_coordinates(names, (1, 2, 2, 2, 1), (0, 1, 0, 1, 0))
    -> {"dp_rank": 2, "dp_size": 4, "pp_rank": 0, "pp_size": 1, "cp_rank": 1, "cp_size": 2,
        "tp_rank": 0, "tp_size": 1}      # dp_rank = 1 * 2 + 0, dp_size = 2 * 2: Topology(**...)
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import Any

from rollfeed.collate.errors import MeshAxisError

DATA_AXES = ("dp", "dp_replicate", "dp_shard", "fsdp", "ddp")
SHARING_AXES = ("cp", "tp", "pp")
# Names of one role: a mesh that holds two of them says the same thing twice (or, with ``dp``,
# counts the data ranks twice: ``dp`` is torchtitan's flattened dp_replicate x dp_shard).
_SYNONYMS = (("dp_replicate", "ddp"), ("dp_shard", "fsdp"))


def check_axis_names(names: Sequence[str]) -> None:
    """Raise :class:`MeshAxisError` for a name outside the table or an ambiguous set of names."""
    for name in names:
        if name == "ep":
            raise MeshAxisError(
                "'ep' is a dimension of this mesh; rollfeed accepts expert parallelism only as a "
                "flattened view of its data axes (e.g. mesh['dp_shard', 'cp']._flatten('ep')), "
                "since ranks of an axis of its own may or may not need their own data",
                axis=name,
            )
        if name not in DATA_AXES + SHARING_AXES:
            raise MeshAxisError(
                f"mesh dimension {name!r} is not in the axis table: data axes {DATA_AXES} select "
                f"the micro batches, sharing axes {SHARING_AXES} share them; rename the "
                "dimension or pass the sub-mesh of the axes rollfeed should read",
                axis=name,
            )
    data = [n for n in names if n in DATA_AXES]
    if "dp" in data and len(data) > 1:
        raise MeshAxisError(
            f"mesh dimensions {tuple(names)} name 'dp' together with other data axes; 'dp' is "
            "the flattened data axis, so the data ranks would be counted twice: pass "
            "either 'dp' or its parts",
            axis="dp",
        )
    for pair in _SYNONYMS:
        if all(n in names for n in pair):
            raise MeshAxisError(
                f"mesh dimensions {pair} name the same data axis twice; keep one of them",
                axis=pair[1],
            )


def mesh_coordinates(
    names: Sequence[str], sizes: Sequence[int], ranks: Sequence[int]
) -> dict[str, int]:
    """This rank's ``Topology`` fields (``dp_rank``, ``dp_size`` and each sharing axis's rank and
    size present) from the mesh's dimension names, sizes and the rank's local rank along each
    (pure; see the module doc's worked example). An axis the mesh lacks is left out (size 1)."""
    check_axis_names(names)
    dp_rank = 0
    for name, size, rank in zip(names, sizes, ranks, strict=True):
        if name in DATA_AXES:
            dp_rank = dp_rank * size + rank
    kw: dict[str, int] = {
        "dp_rank": dp_rank,
        "dp_size": prod(s for n, s in zip(names, sizes, strict=True) if n in DATA_AXES),
    }
    for name, size, rank in zip(names, sizes, ranks, strict=True):
        if name in SHARING_AXES:
            kw[f"{name}_rank"], kw[f"{name}_size"] = rank, size
    return kw


def read_mesh(mesh: Any) -> dict[str, int]:
    """:func:`mesh_coordinates` of a ``torch.distributed.device_mesh.DeviceMesh`` for this rank.

    Its dimensions must all be named (``init_device_mesh(..., mesh_dim_names=...)``).
    """
    names = tuple(mesh.mesh_dim_names or ())
    if len(names) != mesh.ndim:
        raise MeshAxisError(
            f"the mesh has {mesh.ndim} dimensions but names {names}; build it with "
            "init_device_mesh(..., mesh_dim_names=(...)) so each axis can be read by name"
        )
    sizes = [mesh.size(i) for i in range(mesh.ndim)]
    ranks = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    return mesh_coordinates(names, sizes, ranks)
