"""Run under torchrun (4 gloo ranks): every rank's loader output equals the one-process reference.

Args: ``RUN_DIR CP_SIZE``; ``RUN_DIR`` holds ``payload/`` and ``steps/step_000000.rfs``. For
``num_workers`` 0 and 2 and both CP layouts each rank asserts its TensorMicroBatches equal, bitwise,
``prepare_batch`` + ``to_tensor_micro_batch`` for its (dp, cp); rank 0 then checks, over a gather,
that CP peers saw the same micro batches in the same order and that the DP ranks' micro batches
cover every sample exactly once, and writes ``RUN_DIR/ok_cp{CP_SIZE}.json``. Each rank also
resumes a state of its own under another plan and another world shape
(:func:`resume_under_other_shapes`), and rank 0 checks that the resized ranks cover every sample
once.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch.distributed as dist

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    LoaderOptions,
    LoaderStateError,
    RolloutDataset,
    Topology,
    build_dataloader,
    read_step_file,
)
from tests.dist.launch import run_rank
from tests.loaders.common import SEQ_LEN, assert_bitwise, reference


def main(run: str, cp_size: int) -> None:
    topo = Topology.from_process_group(cp_size=cp_size)
    steps, root = os.path.join(run, "steps"), os.path.join(run, "payload")
    samples = read_step_file(os.path.join(steps, "step_000000.rfs"))
    seen = {}
    for cp_layout in ("contiguous", "zigzag"):
        ref, _ = reference(
            samples, dp_size=topo.dp_size, cp_size=cp_size, cp_layout=cp_layout, root=root
        )
        mine = ref[topo.dp_rank, topo.cp_rank]
        for num_workers in (0, 2):
            ds = RolloutDataset.from_step_dir(steps)
            # the plan's cp_size is the topology's: stated once, in from_process_group
            config = LoaderConfig(plan=PlanConfig(seq_len=SEQ_LEN, cp_layout=cp_layout))
            options = LoaderOptions(num_workers=num_workers)
            loader = build_dataloader(ds, topo, config, root=root, options=options)
            indices = loader.batch_sampler.step_micro_batches(0)
            got = list(loader)
            loader.close()  # its workers (and receive thread) end here, not at interpreter exit
            assert len(got) == len(mine) == len(indices), (len(got), len(mine), len(indices))
            for k, (a, b) in enumerate(zip(got, mine, strict=True)):
                assert_bitwise(a, b, (topo, cp_layout, num_workers, k))
            rows = [(t.seq_lens.tolist(), t.cu_seqlens.tolist()) for t in got]
            seen[cp_layout, num_workers] = (indices, rows)
    resized = resume_under_other_shapes(topo, steps, root, samples)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (topo.dp_rank, topo.cp_rank, sorted(seen.items())))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, resized)
    if dist.get_rank() == 0:
        by_dp: dict[int, list] = {}
        for dp, cp, items in gathered:
            by_dp.setdefault(dp, []).append((cp, items))
        assert sorted(by_dp) == list(range(topo.dp_size))
        for peers in by_dp.values():
            assert sorted(cp for cp, _ in peers) == list(range(cp_size))
            assert all(items == peers[0][1] for _, items in peers), "CP peers differ"
        for key_index in range(4):  # every (layout, workers) config
            union = [
                i for peers in by_dp.values() for mb in peers[0][1][key_index][1][0] for i in mb
            ]
            assert sorted(union) == list(range(len(samples))), "DP ranks do not cover once"
        union = sorted(i for mbs in every for mb in mbs for i in mb)
        assert union == list(range(len(samples))), "the resized ranks do not cover once"
        with open(os.path.join(run, f"ok_cp{cp_size}.json"), "w") as f:
            json.dump({"ranks": len(gathered), "samples": len(samples)}, f)


def resume_under_other_shapes(topo: Topology, steps: str, root: str, samples) -> list[list[int]]:
    """This rank's state saved after its first micro batch of step 0, loaded under another plan
    (refused, naming ``seq_len``), under ``dp = world, cp = 1`` (refused, naming both sizes) and
    so with ``on_reshard="restart_step"``: the step replanned for the new shape from its start,
    bitwise the one-process reference. Returns the resized rank's micro batches (indices)."""
    plan, world = PlanConfig(seq_len=SEQ_LEN), dist.get_world_size()

    def loader(topology: Topology, plan: PlanConfig, **config):
        ds = RolloutDataset.from_step_dir(steps)
        return build_dataloader(ds, topology, LoaderConfig(plan=plan, **config), root=root)

    first = loader(topo, plan)
    it = iter(first)
    next(it)
    it.close()
    state = json.loads(json.dumps(first.state_dict()))
    assert (state["step"], state["micro_batches"]) == (0, 1), state
    longer = loader(topo, PlanConfig(seq_len=2 * SEQ_LEN))
    with pytest.raises(LoaderStateError, match=rf"seq_len: {SEQ_LEN} -> {2 * SEQ_LEN}"):
        longer.load_state_dict(state)
    flat = Topology.from_rank(dist.get_rank(), world)  # every rank its own DP rank
    shape = rf"dp_size: {topo.dp_size} -> {world}; cp_size: {topo.cp_size} -> 1"
    with pytest.raises(LoaderStateError, match=shape):
        loader(flat, plan).load_state_dict(state)
    resized = loader(flat, plan, on_reshard="restart_step")
    resized.load_state_dict(state)
    got = list(resized)
    ref, _ = reference(samples, dp_size=world, cp_size=1, cp_layout="contiguous", root=root)
    assert len(got) == len(ref[flat.dp_rank, 0]) > 0
    for k, (a, b) in enumerate(zip(got, ref[flat.dp_rank, 0], strict=True)):
        assert_bitwise(a, b, ("resized", flat, k))
    return [list(mb) for mb in resized.batch_sampler.step_micro_batches(0)]


if __name__ == "__main__":
    run_rank(main, sys.argv[1], int(sys.argv[2]))
