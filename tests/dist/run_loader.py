"""Run under torchrun (4 gloo ranks): every rank's loader output equals the one-process reference.

Args: ``RUN_DIR CP_SIZE``; ``RUN_DIR`` holds ``payload/`` and ``steps/step_000000.jsonl``. For
``num_workers`` 0 and 2 and both CP layouts each rank asserts its TensorMicroBatches equal, bitwise,
``prepare_batch`` + ``to_tensor_micro_batch`` for its (dp, cp); rank 0 then checks, over a gather,
that CP peers saw the same micro batches in the same order and that the DP ranks' micro batches
cover every sample exactly once, and writes ``RUN_DIR/ok_cp{CP_SIZE}.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderOptions,
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
    samples = read_step_file(os.path.join(steps, "step_000000.jsonl"))
    seen = {}
    for cp_layout in ("contiguous", "zigzag"):
        ref, _ = reference(
            samples, dp_size=topo.dp_size, cp_size=cp_size, cp_layout=cp_layout, root=root
        )
        mine = ref[topo.dp_rank, topo.cp_rank]
        for num_workers in (0, 2):
            ds = RolloutDataset.from_step_dir(steps)
            config = PlanConfig(seq_len=SEQ_LEN, cp_size=cp_size, cp_layout=cp_layout)
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
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (topo.dp_rank, topo.cp_rank, sorted(seen.items())))
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
        with open(os.path.join(run, f"ok_cp{cp_size}.json"), "w") as f:
            json.dump({"ranks": len(gathered), "samples": len(samples)}, f)


if __name__ == "__main__":
    run_rank(main, sys.argv[1], int(sys.argv[2]))
