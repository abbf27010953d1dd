"""The mesh axis table: data axes flatten into dp in mesh order, sharing axes are read as they
are, anything else is refused by name."""

from __future__ import annotations

import itertools
from math import prod

import pytest

from rollfeed.collate import MeshAxisError, Topology
from rollfeed.collate.mesh_axes import mesh_coordinates

TORCHTITAN = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def _local_ranks(shape, rank):
    """Row-major coordinates of ``rank`` in a grid of ``shape`` (what DeviceMesh gives)."""
    out = []
    for size in reversed(shape):
        out.append(rank % size)
        rank //= size
    return out[::-1]


@pytest.mark.parametrize("shape", [(1, 2, 2, 2, 1), (2, 1, 3, 1, 2), (2, 2, 2, 1, 2)])
def test_data_axes_flatten_in_mesh_order_and_cover_every_coordinate_once(shape):
    world = prod(shape)
    pp, dpr, dps, cp, tp = shape
    seen = set()
    for rank in range(world):
        c = Topology(**mesh_coordinates(TORCHTITAN, shape, _local_ranks(shape, rank)))
        assert c.dp_size == dpr * dps and (c.cp_size, c.tp_size, c.pp_size) == (cp, tp, pp)
        seen.add((c.pp_rank, c.dp_rank, c.cp_rank, c.tp_rank))
        # The same rank in torchtitan's flattened ``dp`` view: dp_replicate x dp_shard.
        names = ("pp", "dp", "cp", "tp")
        flat = Topology(**mesh_coordinates(names, (pp, dpr * dps, cp, tp), _flat(shape, rank)))
        assert flat == c
    assert seen == set(itertools.product(range(pp), range(dpr * dps), range(cp), range(tp)))


def _flat(shape, rank):
    pp, dpr, dps, cp, tp = _local_ranks(shape, rank)
    return [pp, dpr * shape[2] + dps, cp, tp]


def test_missing_axes_have_size_one_and_fsdp_ddp_are_data_axes():
    assert mesh_coordinates(("ddp", "fsdp"), (2, 3), (1, 2)) == {"dp_rank": 5, "dp_size": 6}
    assert Topology(**mesh_coordinates((), (), ())) == Topology()


@pytest.mark.parametrize(
    ("names", "axis", "match"),
    [
        (("dp", "sp"), "sp", "not in the axis table"),
        (("dp_shard", "ep"), "ep", "'ep' is a dimension"),
        (("dp", "dp_shard"), "dp", "counted twice"),
        (("dp_shard", "fsdp"), "fsdp", "same data axis twice"),
        (("ddp", "dp_replicate", "cp"), "ddp", "same data axis twice"),
    ],
)
def test_unknown_and_ambiguous_axes_are_refused_by_name(names, axis, match):
    with pytest.raises(MeshAxisError, match=match) as err:
        mesh_coordinates(names, (2,) * len(names), (0,) * len(names))
    assert err.value.axis == axis
