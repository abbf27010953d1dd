"""``Topology.from_mesh`` on torchtitan-style 4-rank meshes against the flat ``Topology.from_rank``.

For each mesh (names ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` in torchtitan's order,
sizes 1 or 2), the topology read from the mesh equals ``from_rank`` with the same sizes, and the
planner gives every rank the micro batches its flat coordinates select: the ranks that share a
dp coordinate (their cp / tp / pp peers) get the same samples, the dp ranks together get every
sample once. A flattened ``dp`` view selects as its parts do, and a flattened ``ep`` view carved
from ``dp_shard x cp`` leaves the reading of the mesh unchanged. Unknown names, ``ep`` as a real
dimension and synonyms together raise ``MeshAxisError`` naming the axis, from ``Topology`` and
from the scorer's ``CPGroup`` alike.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from rollfeed.collate import MeshAxisError, PlanConfig, prepare_batch
from rollfeed.loaders import Topology
from rollfeed.models import CPGroup
from tests.dist.policy_cases import make_samples

NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SHAPES = (
    (1, 2, 2, 1, 1),
    (2, 1, 2, 1, 1),
    (1, 2, 1, 1, 2),
    (1, 1, 2, 2, 1),
    (2, 1, 1, 2, 1),
    (1, 1, 1, 2, 2),
)
REFUSED = {
    ("dp_shard", "expert"): "expert",
    ("ep", "tp"): "ep",
    ("dp", "dp_shard"): "dp",
    ("dp_shard", "fsdp"): "fsdp",
    ("ddp", "dp_replicate"): "ddp",
}


def selected(topo: Topology, samples: list) -> tuple[int, ...]:
    config = PlanConfig(seq_len=32, cp_size=topo.cp_size, pad_to_multiple_of=4)
    plan = prepare_batch(samples, config, dp_size=topo.dp_size)
    return tuple(sorted(i for mb in plan[topo.dp_rank] for i in mb.indices))


def check_selection(names: tuple[str, ...], shape: tuple[int, ...], topo: Topology) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    size = dict(zip(names, shape, strict=True))
    flat = Topology.from_rank(
        rank,
        world,
        cp_size=size.get("cp", 1),
        tp_size=size.get("tp", 1),
        pp_size=size.get("pp", 1),
    )
    assert topo == flat, (names, shape, topo, flat)
    samples = make_samples(9, [11, 6, 14, 9, 5, 13, 8, 10, 7])
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (flat.dp_rank, selected(topo, samples)))
    by_dp: dict[int, set] = {}
    for dp_rank, indices in everyone:
        by_dp.setdefault(dp_rank, set()).add(indices)
    assert all(len(v) == 1 for v in by_dp.values()), (names, shape, by_dp)
    chosen = sorted(i for (indices,) in by_dp.values() for i in indices)
    assert chosen == list(range(len(samples))), (names, shape, chosen)


def check_topology_from_mesh(meshes) -> None:  # type: ignore[no-untyped-def]
    """Every mesh of :data:`SHAPES`, then the refused names; ``meshes`` collects the roots so
    their process groups are released at the end."""
    for shape in SHAPES:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=NAMES)
        meshes.roots[NAMES + shape] = mesh
        topo = Topology.from_mesh(mesh)
        check_selection(NAMES, shape, topo)
        if shape[1] * shape[2] > 1:
            dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
            view = Topology.from_mesh(dp)
            assert (view.dp_rank, view.dp_size) == (topo.dp_rank, topo.dp_size), (shape, view)
        if shape[2] * shape[3] > 1:
            mesh["dp_shard", "cp"]._flatten("ep")
            assert Topology.from_mesh(mesh) == topo, shape
    for names, axis in REFUSED.items():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        meshes.roots[names] = mesh
        for read in (Topology.from_mesh, CPGroup.from_mesh):
            with pytest.raises(MeshAxisError, match=repr(axis)) as err:
                read(mesh)
            assert err.value.axis == axis, (names, err.value)
