"""Run under two torchrun "nodes" (2 ranks each, DP 2 x CP 2) with payload and step files only
in an object store: each rank loads its micro batches and saves them in its own working directory.

Args: ``URL`` (``s3://bucket/prefix`` holding ``payload/`` and ``steps/``; the store's endpoint
and credentials come from the ``AWS_*`` variables). With 2 loader workers and the zigzag layout,
each rank writes ``out_dp{D}_cp{C}.pt`` (its TensorMicroBatches) in its working directory; rank 0
checks over a gather that the DP ranks' micro batches cover every sample exactly once and that CP
peers saw the same micro batches, and writes ``ok.json``.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from rollfeed.collate import PlanConfig, RaggedRows
from rollfeed.loaders import LoaderConfig, LoaderOptions, RolloutDataset, Topology, build_dataloader
from tests.dist.launch import run_rank
from tests.loaders.common import SEQ_LEN


def _owned(tmb):
    """The micro batch with every tensor in storage of its own (torch.save refuses tensors that
    view one buffer as different dtypes)."""

    def own(v):
        if isinstance(v, torch.Tensor):
            return v.clone()
        if isinstance(v, RaggedRows):
            return v.apply(torch.Tensor.clone)
        return {k: own(x) for k, x in v.items()} if isinstance(v, dict) else v

    return dataclasses.replace(
        tmb, **{f.name: own(getattr(tmb, f.name)) for f in dataclasses.fields(tmb)}
    )


def main(url: str) -> None:
    topo = Topology.from_process_group(cp_size=2)
    ds = RolloutDataset.from_step_dir(f"{url}/steps")
    config = PlanConfig(seq_len=SEQ_LEN, cp_size=2, cp_layout="zigzag")
    options = LoaderOptions(num_workers=2)
    loader = build_dataloader(
        ds, topo, LoaderConfig(plan=config), root=f"{url}/payload", options=options
    )
    indices = loader.batch_sampler.step_micro_batches(0)
    got = list(loader)
    loader.close()
    assert len(got) == len(indices) > 0
    torch.save([_owned(t) for t in got], f"out_dp{topo.dp_rank}_cp{topo.cp_rank}.pt")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (topo.dp_rank, topo.cp_rank, [list(m) for m in indices]))
    if dist.get_rank() == 0:
        by_dp: dict[int, list] = {}
        for dp, _, mbs in gathered:
            by_dp.setdefault(dp, []).append(mbs)
        assert sorted(by_dp) == [0, 1]
        assert all(p == peers[0] for peers in by_dp.values() for p in peers), "CP peers differ"
        union = sorted(i for peers in by_dp.values() for mb in peers[0] for i in mb)
        n = len(ds.lengths(0))
        assert union == list(range(n)), "DP ranks do not cover every sample once"
        with open("ok.json", "w") as f:
            json.dump({"ranks": len(gathered), "samples": n}, f)


if __name__ == "__main__":
    run_rank(main, sys.argv[1])
