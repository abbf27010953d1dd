"""Demo trainer ranks: read the step by handle, score with and without support replay.

Run under torchrun (gloo), e.g. 2 DP x 2 CP ranks::

    torchrun --standalone --nproc_per_node=4 -m rollfeed.demo.trainer \\
        --model-dir M --workdir W --cp 2

Each rank builds its :class:`~rollfeed.loaders.Topology`, a loader over ``W/steps`` that reads
only this rank's windows of ``W/payload``, and a :class:`~rollfeed.models.PolicyScorer` (Ulysses
over the rank's ``cp`` group) on the same weights the sampler used. Every loss-bearing token is
scored twice: over its recorded kept set (support replay) and over the full vocabulary. Rank 0
writes ``W/trainer.json`` with the per-token differences to the sampler's logprobs.

The process ends normally: the loader is closed (its workers and thread end), and every process
group is destroyed and no longer referenced when ``main`` returns, so no gloo worker thread is left
to release a collective's tensors during interpreter teardown (which aborts the process). The
model classes are imported before ``init_process_group`` for the same reason: transformers' model
code imports ``torch.distributed.nn.functional``, whose functions take ``group.WORLD`` as a default
argument; imported after the default group exists, it would hold that group for good.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from rollfeed.collate import PlanConfig
from rollfeed.loaders import LoaderOptions, RolloutDataset, Topology, build_dataloader
from rollfeed.models import CPGroup, PolicyScorer


def score_step(args: argparse.Namespace) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_rank(rank, world, cp_size=args.cp)
    # Every rank creates every cp group, in the same order (a torch.distributed rule); the ranks
    # of DP coordinate d are d * cp .. d * cp + cp - 1 in the Topology's rank order (dp, cp, tp).
    groups = [
        dist.new_group(list(range(d * args.cp, (d + 1) * args.cp))) for d in range(topo.dp_size)
    ]
    cp = CPGroup(group=groups[topo.dp_rank], rank=topo.cp_rank, size=topo.cp_size)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    scorer = PolicyScorer(model, cp=cp)
    loader = build_dataloader(
        RolloutDataset.from_step_dir(args.workdir / "steps"),
        topo,
        PlanConfig(seq_len=args.seq_len, cp_size=args.cp, cp_layout="zigzag"),
        root=args.workdir / "payload",
        options=LoaderOptions(num_workers=1),
    )
    sampler_lp, replay_lp, full_lp, kept = [], [], [], []
    wait = score = 0.0
    micro_batches = 0
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        tmb = next(it, None)
        wait += time.perf_counter() - t0
        if tmb is None:
            loader.close()  # the workers end now, not at interpreter exit
            break
        micro_batches += 1
        t0 = time.perf_counter()
        with torch.no_grad():
            replay = scorer.score(tmb)
            no_support = torch.full((tmb.input_ids.numel(), 1), -1, dtype=torch.int32)
            full = scorer.score_tokens(
                tmb.input_ids,
                tmb.position_ids,
                tmb.labels,
                no_support,
                temperature=tmb.temperatures,
                canonical_index=tmb.positions,
                cu_seqlens=tmb.cu_seqlens,
                fallback_mask=tmb.loss_mask,
            )
        score += time.perf_counter() - t0
        # Results are whole-row (canonical); each rank keeps its own positions, so the cp peers
        # of a micro batch count every token exactly once.
        own, loss = tmb.positions, tmb.loss_mask
        sampler_lp.append(tmb.inference_logprobs[loss].double())
        replay_lp.append(replay.logprobs[own][loss].double())
        full_lp.append(full.logprobs[own][loss].double())
        kept.append((tmb.fields["sampling_mask"] >= 0).sum(-1)[loss])
    cat = lambda xs, d: torch.cat(xs).numpy() if xs else np.zeros(0, d)  # noqa: E731
    mine = {
        "rank": rank,
        "dp_rank": topo.dp_rank,
        "cp_rank": topo.cp_rank,
        "micro_batches": micro_batches,
        "loader_wait_s": wait,
        "score_s": score,
        "sampler": cat(sampler_lp, np.float64).tolist(),
        "replay": cat(replay_lp, np.float64).tolist(),
        "full": cat(full_lp, np.float64).tolist(),
        "kept": cat(kept, np.int64).tolist(),
    }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    return {"world": world, "cp": args.cp, "ranks": gathered} if rank == 0 else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollfeed.demo.trainer")
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result = score_step(args)
        if result is not None:
            (args.workdir / "trainer.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()  # the default group and every cp group


if __name__ == "__main__":
    main()
