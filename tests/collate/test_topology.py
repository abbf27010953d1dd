"""Topology: rank arithmetic, validation, and the mesh / process group constructors."""

from __future__ import annotations

import itertools

import pytest

from rollfeed.collate import BatchConfigError, MeshAxisError, PlanConfig, Topology
from rollfeed.loaders import Topology as LoaderTopology


def test_from_rank_covers_grid_once_tp_innermost():
    world, cp, tp = 24, 3, 2
    seen = set()
    for rank in range(world):
        t = Topology.from_rank(rank, world, cp_size=cp, tp_size=tp)
        assert t.dp_size == 4 and t.world_size == world
        assert rank == (t.dp_rank * cp + t.cp_rank) * tp + t.tp_rank
        seen.add((t.dp_rank, t.cp_rank, t.tp_rank))
    assert seen == set(itertools.product(range(4), range(cp), range(tp)))
    assert Topology.from_rank(5, 8, cp_size=2, tp_size=2) == Topology(
        dp_rank=1, dp_size=2, cp_rank=0, cp_size=2, tp_rank=1, tp_size=2
    )


def test_from_rank_puts_pp_outermost():
    world, pp, cp, tp = 24, 2, 2, 2
    seen = set()
    for rank in range(world):
        t = Topology.from_rank(rank, world, cp_size=cp, tp_size=tp, pp_size=pp)
        assert t.dp_size == 3 and t.world_size == world
        assert rank == ((t.pp_rank * 3 + t.dp_rank) * cp + t.cp_rank) * tp + t.tp_rank
        seen.add((t.pp_rank, t.dp_rank, t.cp_rank, t.tp_rank))
    assert len(seen) == world


def test_rejects_bad_sizes_and_ranks():
    with pytest.raises(BatchConfigError, match="cp_rank"):
        Topology(dp_rank=0, dp_size=1, cp_rank=2, cp_size=2)
    with pytest.raises(BatchConfigError, match="multiple"):
        Topology.from_rank(0, 6, cp_size=4)
    with pytest.raises(BatchConfigError, match="tp_size must be an int >= 1, got 0"):
        Topology.from_rank(0, 6, tp_size=0)


def test_the_sequence_axis_is_cp_only():
    # One axis a row is split over: there is no second name for it to disagree with.
    with pytest.raises(TypeError, match="sp_rank"):
        Topology(dp_rank=0, dp_size=1, sp_rank=0, sp_size=2)
    with pytest.raises(TypeError, match="sp_size"):
        Topology.from_rank(0, 4, sp_size=2)
    with pytest.raises(MeshAxisError, match="'sp'") as err:
        Topology.from_mesh(_Mesh(("dp", "sp"), (2, 2), (0, 1)))
    assert err.value.axis == "sp"
    with pytest.raises(BatchConfigError, match="not initialised"):
        Topology.from_process_group(cp_size=2)


class _Mesh:  # the DeviceMesh attributes read_mesh uses (real meshes: tests/dist/)
    def __init__(self, names, shape, coord):
        self.mesh_dim_names, self._shape, self._coord = names, shape, coord
        self.ndim = len(shape)

    def size(self, dim):
        return self._shape[dim]

    def get_local_rank(self, dim):
        return self._coord[dim]


def test_from_mesh_reads_the_axis_table():
    t = Topology.from_mesh(_Mesh(("dp", "cp", "tp"), (3, 2, 2), (2, 1, 0)))
    assert t == Topology(dp_rank=2, dp_size=3, cp_rank=1, cp_size=2, tp_rank=0, tp_size=2)
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    t = Topology.from_mesh(_Mesh(names, (2, 2, 3, 2, 1), (1, 1, 2, 0, 0)))
    assert t == Topology(dp_rank=5, dp_size=6, cp_rank=0, cp_size=2, pp_rank=1, pp_size=2)
    with pytest.raises(MeshAxisError, match="'ep' is a dimension") as err:
        Topology.from_mesh(_Mesh(("dp", "ep"), (2, 2), (0, 0)))
    assert err.value.axis == "ep"


def test_the_loaders_topology_is_the_collate_one():
    assert LoaderTopology is Topology
    assert Topology() == Topology(dp_rank=0, dp_size=1)  # one process


def test_a_plan_takes_the_cp_size_of_the_topology_it_is_bound_to():
    topo = Topology(dp_rank=1, dp_size=2, cp_rank=1, cp_size=2)
    bound = topo.bind(PlanConfig(seq_len=8, cp_layout="zigzag"))
    assert bound == PlanConfig(seq_len=8, cp_size=2, cp_layout="zigzag") and bound.pad == 4
    same = PlanConfig(seq_len=8, cp_size=2)
    assert topo.bind(same) is same
    with pytest.raises(BatchConfigError, match=r"topology\.cp_size=2 but plan\.cp_size=4"):
        topo.bind(PlanConfig(seq_len=8, cp_size=4))
    # bound, the plan is checked again for its new pad multiple (4 for zigzag over 2 ranks)
    with pytest.raises(BatchConfigError, match=r"seq_len=6 is not a multiple .* 4"):
        topo.bind(PlanConfig(seq_len=6, cp_layout="zigzag"))
