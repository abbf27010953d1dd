"""Demo trainer ranks: read the step by handle, score it, train on it for a few steps, checkpoint.

Run under torchrun (gloo), e.g. 2 DP x 2 CP ranks::

    torchrun --standalone --nproc_per_node=4 -m rollfeed.demo.trainer \\
        --model-dir M --workdir W --cp 2 --steps 3 --checkpoint-every 1

Each rank builds a ``(dp, cp)`` device mesh, its :class:`~rollfeed.collate.Topology`, a loader
that reads only this rank's windows of ``W/payload`` for the samples of the step file in
``W/steps``, the model the sampler used sharded with FSDP2 (:mod:`rollfeed.demo.train`) and a
:class:`~rollfeed.models.PolicyScorer` (Ulysses over the rank's ``cp`` group). The captured step
is trained on ``--steps`` times (off-policy epochs: one loader pass and one AdamW step each;
nothing goes back to the sampler). Every loss token is scored before each update; at step 0 it is
also scored over the full vocabulary, so the report can separate the numerics (support replay
against full vocabulary, before any update) from the drift the updates cause.

Rank 0 writes ``W/trainer.json``::

    {"world": 4, "cp": 2, "steps": 3, "clip_eps": 0.2, "correction": "tis", "centering": true,
     "lr": 1e-5,
     "ranks": [per rank, step 0: sampler / replay / full logprobs and kept-set sizes per token,
               micro_batches, loader_wait_s, score_s, rank, dp_rank, cp_rank],
     "train": [per step: step, loss, tokens, clipped, step_s, objective (the objectives'
               metrics over all ranks), and over all ranks' tokens delta (trainer − sampler
               logprob before the update) and entropy (kept set)]}

The loss (:mod:`rollfeed.demo.objective`) is chosen by ``--clip-eps`` (0: no clip),
``--correction`` and ``--centering`` / ``--no-centering``.

``--checkpoint-every K`` saves a DCP checkpoint to ``W/checkpoints/step_<k>`` after every K-th
step and after the last; the checkpoint also holds ``trainer.json`` as it stood. ``--resume``
continues from the newest complete checkpoint there: the same result as a run never stopped.

The process ends without interpreter teardown (:func:`end_process`, after the loader is closed,
``trainer.json`` written and every process group destroyed). torch's DTensor keeps device meshes in
process-wide caches (sharding propagation, redistribution planners, mesh topology) that torch
offers no public way to clear, and a mesh holds its process groups; a gloo group still alive when
the interpreter finalizes can abort it from a worker thread that needs the GIL to free a tensor.
Skipping finalization, once everything is written and flushed, leaves no such window. The model
classes are imported before ``init_process_group``: transformers' model code imports
``torch.distributed.nn.functional``, whose functions take ``group.WORLD`` as a default argument;
imported after the default group exists, it would hold that group for good.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from rollfeed.collate import PlanConfig, TensorMicroBatch
from rollfeed.demo.objective import CORRECTIONS, DemoObjective
from rollfeed.demo.train import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    shard_model,
    train_step,
)
from rollfeed.loaders import (
    LoaderConfig,
    LoaderOptions,
    RolloutDataset,
    Topology,
    build_dataloader,
    read_step_file,
)
from rollfeed.models import PolicyScorer

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def step_file(workdir: Path) -> Path:
    """The captured step: the first step file in ``workdir/steps``."""
    files = sorted((workdir / "steps").glob("step_*.rfs"))
    if not files:
        raise SystemExit(f"no step file in {workdir / 'steps'}: run the rollouts stage first")
    return files[0]


def full_vocab(scorer: PolicyScorer, mb: TensorMicroBatch) -> torch.Tensor:
    """Logprobs over the full vocabulary (no kept set) at this rank's positions, no gradient."""
    no_support = torch.full((mb.input_ids.numel(), 1), -1, dtype=torch.int32)
    with torch.no_grad():
        out = scorer.score_tokens(
            mb.input_ids,
            mb.position_ids,
            mb.labels,
            no_support,
            temperature=mb.temperatures,
            canonical_index=mb.positions,
            cu_seqlens=mb.cu_seqlens,
            fallback_mask=mb.loss_mask,
        )
    return out.logprobs[mb.positions]


def numerics(scorer: PolicyScorer, batches: list[TensorMicroBatch], wait: float) -> dict:
    """This rank's step-0 record before any update: logprobs over the full vocabulary; the
    replay logprobs are added from the training forward (the same weights)."""
    t0 = time.perf_counter()
    full = [full_vocab(scorer, mb)[mb.loss_mask].double() for mb in batches]
    return {
        "micro_batches": len(batches),
        "loader_wait_s": wait,
        "score_s": time.perf_counter() - t0,
        "full": (torch.cat(full) if full else torch.zeros(0, dtype=torch.float64)).tolist(),
    }


def train(args: argparse.Namespace) -> None:
    """The whole run on this rank (collective; a new mesh, model and loader on every call)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.cp, args.cp), mesh_dim_names=("dp", "cp"))
    # FSDP2 over every rank: the dp x cp mesh flattened in mesh order, as torchtitan shards its
    # data and cp axes alike (here dp x cp is the whole world, so a 1-D mesh of it is that).
    fsdp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_cp",))
    topo = Topology.from_mesh(mesh)
    dtype = DTYPES[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype)
    if hasattr(model.config, "_experts_implementation") and dtype == torch.float64:
        model.set_experts_implementation("eager")  # the grouped-mm kernels refuse float64
    shard_model(model, fsdp_mesh)
    scorer = PolicyScorer.from_mesh(model, mesh, compute_entropy=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    loader = build_dataloader(
        RolloutDataset(read_step_file(step_file(args.workdir))),  # the same samples every pass
        topo,  # the plan's cp_size is the mesh's
        LoaderConfig(plan=PlanConfig(seq_len=args.seq_len, cp_layout="zigzag")),
        root=args.workdir / "payload",
        options=LoaderOptions(num_workers=args.workers),
    )
    checkpoints = args.workdir / "checkpoints"
    objective = DemoObjective(
        clip_eps=args.clip_eps, correction=args.correction, centering=args.centering
    )
    result = {"world": world, "cp": args.cp, "steps": args.steps, "clip_eps": args.clip_eps}
    result |= {"correction": args.correction, "centering": args.centering}
    result |= {"lr": args.lr, "ranks": [], "train": []}
    done = 0
    resume = latest_checkpoint(checkpoints) if args.resume else None
    if args.resume and resume is None:
        raise SystemExit(
            f"--resume: no complete checkpoint (a step_* directory with .metadata) under "
            f"{checkpoints}; run without --resume, with --checkpoint-every K, first"
        )
    if resume is not None:
        done = load_checkpoint(resume, model, optimizer, loader)
        result = json.loads((resume / "trainer.json").read_text()) | {"steps": args.steps}
        logger.info("resumed from %s after %d steps", resume, done)
    for step in range(done, args.steps):
        t0 = time.perf_counter()
        batches = list(loader)  # one pass: this rank's micro batches of the step
        wait = time.perf_counter() - t0
        before = numerics(scorer, batches, wait) if step == 0 else None
        record = train_step(scorer, batches, optimizer, step=step, objective=objective)
        mine = {"delta": (record.trainer - record.sampler).tolist()}
        mine |= {"entropy": record.entropy.tolist(), "clipped": record.clipped}
        if before is not None:
            before |= {"sampler": record.sampler.tolist(), "replay": record.trainer.tolist()}
            before |= {"kept": record.kept.tolist(), "rank": rank, "dp_rank": topo.dp_rank}
            mine["numerics"] = before | {"cp_rank": topo.cp_rank}
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        if step == 0:
            result["ranks"] = [g["numerics"] for g in gathered]
        result["train"].append(
            {
                "step": step,
                "loss": record.loss,
                "tokens": record.tokens,
                "clipped": sum(g["clipped"] for g in gathered),
                "step_s": record.step_s,
                "objective": record.objective,
                "delta": [d for g in gathered for d in g["delta"]],
                "entropy": [e for g in gathered for e in g["entropy"]],
            }
        )
        last = step + 1 == args.steps
        if args.checkpoint_every and ((step + 1) % args.checkpoint_every == 0 or last):
            path = checkpoint_path(checkpoints, step + 1)
            if rank == 0:  # beside the DCP files, before them: .metadata comes last
                path.mkdir(parents=True, exist_ok=True)
                (path / "trainer.json").write_text(json.dumps(result))
            save_checkpoint(path, model, optimizer, loader)
    loader.close()  # the workers end now, not at interpreter exit
    if rank == 0:
        (args.workdir / "trainer.json").write_text(json.dumps(result))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rollfeed.demo.trainer")
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps on the captured step")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--clip-eps", type=float, default=0.2, help="0: no clip")
    ap.add_argument("--correction", choices=sorted(CORRECTIONS), default="tis")
    ap.add_argument(
        "--centering", action=argparse.BooleanOptionalAction, default=True, help="score centering"
    )
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--workers", type=int, default=1, help="loader worker processes")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="0: no checkpoints")
    ap.add_argument("--resume", action="store_true", help="from W/checkpoints' newest")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        train(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()  # the default group and every mesh group


def end_process() -> NoReturn:
    """Exit 0 without interpreter teardown (see the module doc), logs and output flushed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    end_process()
