"""Demo trainer ranks: train on each step file as it appears, checkpoint, tell the producer.

Run under torchrun (gloo), e.g. 2 DP x 2 CP ranks::

    torchrun --standalone --nproc_per_node=4 -m rollfeed.demo.trainer \\
        --model-dir M --workdir W --cp 2 --steps 4 --checkpoint-every 1 --progress

Each rank builds a ``(dp, cp)`` device mesh, its :class:`~rollfeed.collate.Topology`, a loader
that streams the step files of ``W/steps`` (step ``k`` is optimizer step ``k``: the pass waits for
its file) and reads only this rank's windows of ``W/payload``, the model sharded with FSDP2
(:mod:`rollfeed.demo.train`) and a :class:`~rollfeed.models.PolicyScorer` (Ulysses over the rank's
``cp`` group). Each step: one loader pass, one AdamW step, every loss token scored before the
update. The first step of fresh weights is also scored over the full vocabulary, so the report can
separate numerics (support replay against full vocabulary) from drift.

After step ``k`` (``--checkpoint-every K``: after every K-th and the last) the ranks save a DCP
checkpoint ``W/checkpoints/step_<k+1>`` (model, AdamW, each rank's loader position, and
``trainer.json`` as it stood); then, with ``--progress``, the weights for the capture server
(``--weights D``: ``D/step_<k+1>``, :func:`rollfeed.models.checkpoint.save_checkpoint`, complete or
absent) and rank 0 writes the trainer's progress file in the step directory
(:mod:`rollfeed.orchestrator.progress`: ``step = version = k + 1``, those weights and that
checkpoint), the producer's signal that step ``k`` is consumed and which weights the server
loads. The progress names only complete checkpoints and weights; a trainer resumed from a
checkpoint writes the weights and progress a crash left out before it trains.

``--max-staleness M --on-stale drop|mask|error``: the loader's staleness bound
(:mod:`rollfeed.loaders.staleness`); each step records ``stale_dropped`` (samples left out),
``stale_masked_tokens``, ``tokens_by_lag`` (loss tokens by lag behind the step), ``partial``
(the samples whose tokens span two versions, with their per-token versions in the micro batch:
:func:`~rollfeed.demo.ledger.partial_rollouts`) and the objective's mismatch metrics by lag
(``lag0_k3``, ``lag1_k3``, ...).

Where it starts: ``--resume`` continues from the newest complete checkpoint (model, AdamW and
loader position; from step 0 when there is none), bitwise as a run never stopped; ``--from K``
starts at step ``K`` from checkpoint ``step_<K>`` (model and AdamW; the loader starts at step
``K``; ``K = 0``: the model directory's weights): training again over recorded steps
(``python -m rollfeed retrain``). ``--steps N``: the step after the last one trained.

Rank 0 writes ``--out`` (default ``W/trainer.json``)::

    {"world": 4, "cp": 2, "steps": 4, "start": 0, "clip_eps": 0.2, "correction": "tis",
     "centering": true, "lr": 1e-5,
     "ranks": [per rank, at the first step of fresh weights: sampler / replay / full logprobs
               and kept-set sizes per token, micro_batches, loader_wait_s, score_s, rank, dp_rank,
               cp_rank],
     "train": [per step: step, loss, tokens, clipped, step_s, objective, delta (trainer − sampler
               logprob before the update) and entropy over every rank's tokens, samples (the
               fingerprints of the samples trained, :mod:`rollfeed.demo.ledger`), digest (of
               the weights after the update)]}

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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from rollfeed.collate import PlanConfig, TensorMicroBatch
from rollfeed.demo.ledger import partial_rollouts, sample_fingerprints, weights_digest
from rollfeed.demo.objective import CORRECTIONS, DemoObjective
from rollfeed.demo.publish import announce, lag_totals
from rollfeed.demo.train import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    shard_model,
    train_step,
)
from rollfeed.loaders import LoaderConfig, LoaderOptions, RolloutDataset, Topology, build_dataloader
from rollfeed.models import PolicyScorer

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def full_vocab(scorer: PolicyScorer, mb: TensorMicroBatch) -> torch.Tensor:
    """Logprobs over the full vocabulary (no kept set) at this rank's positions, no gradient.

    A micro batch holding prefix trees runs its tree row (``mb.tree``), as
    :meth:`~rollfeed.models.PolicyScorer.score` does: its flat rows are split unevenly over the
    cp ranks, so they are no row to run on their own."""
    no_support = torch.full((mb.input_ids.numel(), 1), -1, dtype=torch.int32)
    tree = mb.tree
    with torch.no_grad():
        out = scorer.score_tokens(
            mb.input_ids if tree is None else tree.input_ids,
            mb.position_ids if tree is None else tree.position_ids,
            mb.labels,
            no_support,
            temperature=mb.temperatures,
            canonical_index=mb.positions,
            cu_seqlens=mb.cu_seqlens,
            fallback_mask=mb.loss_mask,
            tree=tree,
        )
    return out.logprobs[mb.positions]


def numerics(scorer: PolicyScorer, batches: list[TensorMicroBatch], wait: float) -> dict:
    """This rank's record before any update: logprobs over the full vocabulary; the replay
    logprobs are added from the training forward (the same weights)."""
    t0 = time.perf_counter()
    full = [full_vocab(scorer, mb)[mb.loss_mask].double() for mb in batches]
    return {
        "micro_batches": len(batches),
        "loader_wait_s": wait,
        "score_s": time.perf_counter() - t0,
        "full": (torch.cat(full) if full else torch.zeros(0, dtype=torch.float64)).tolist(),
    }


def _dirs(args: argparse.Namespace) -> argparse.Namespace:
    """Every directory from ``--workdir`` unless given on its own."""
    work = args.workdir
    for name, default in (
        ("steps_dir", "steps"),
        ("root", "payload"),
        ("checkpoints", "checkpoints"),
    ):
        if getattr(args, name) is None:
            if work is None:
                raise SystemExit(f"--{name.replace('_', '-')} or --workdir is needed")
            setattr(args, name, work / default)
    if args.out is None:
        args.out = (work or args.checkpoints) / "trainer.json"
    return args


def _start(args: argparse.Namespace) -> tuple[int, Path | None]:
    """``(first step, checkpoint to load or None)`` (see the module doc)."""
    if args.start is not None:
        if args.start == 0:
            return 0, None
        path = checkpoint_path(args.checkpoints, args.start)
        if not (path / ".metadata").exists():
            raise SystemExit(f"--from {args.start}: no complete checkpoint at {path}")
        return args.start, path
    latest = latest_checkpoint(args.checkpoints) if args.resume else None
    return (0, None) if latest is None else (int(latest.name.split("_")[1]), latest)


def train(args: argparse.Namespace) -> None:
    """The whole run on this rank (collective; a new mesh, model and loader on every call)."""
    args = _dirs(args)
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
    start, checkpoint = _start(args)
    config = LoaderConfig(
        plan=PlanConfig(seq_len=args.seq_len, cp_layout="zigzag"),
        stream=True,
        start_step=start,
        step_timeout_s=args.step_timeout,
        max_staleness=args.max_staleness,
        on_stale=args.on_stale,
    )
    loader = build_dataloader(
        RolloutDataset.from_step_dir(args.steps_dir),
        topo,  # the plan's cp_size is the mesh's
        config,
        root=args.root,
        options=LoaderOptions(num_workers=args.workers),
    )
    objective = DemoObjective(
        clip_eps=args.clip_eps, correction=args.correction, centering=args.centering
    )
    result = {"world": world, "cp": args.cp, "steps": args.steps, "start": start}
    result |= {"clip_eps": args.clip_eps, "correction": args.correction}
    result |= {"centering": args.centering, "lr": args.lr, "seq_len": args.seq_len}
    result |= {"dtype": args.dtype, "ranks": [], "train": []}
    result |= {"max_staleness": args.max_staleness, "on_stale": args.on_stale}
    if checkpoint is not None:
        resume = args.start is None
        load_checkpoint(checkpoint, model, optimizer, loader if resume else None)
        if resume:
            result = json.loads((checkpoint / "trainer.json").read_text()) | {"steps": args.steps}
        logger.info("started from %s at step %d", checkpoint, start)
        if resume and args.progress:  # a crash may have come between checkpoint and progress
            announce(args, model, start, checkpoint)
    cp_group = scorer.cp.group
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        batches = list(loader)  # one pass: this rank's micro batches of step file `step`
        wait = time.perf_counter() - t0
        before = numerics(scorer, batches, wait) if step == 0 else None
        record = train_step(scorer, batches, optimizer, step=step, objective=objective)
        mine = {"delta": (record.trainer - record.sampler).tolist()}
        mine |= {"entropy": record.entropy.tolist(), "clipped": record.clipped}
        mine["samples"] = [f for mb in batches for f in sample_fingerprints(mb, cp_group)]
        mine["partial"] = [p for mb in batches for p in partial_rollouts(mb, cp_group)]
        metrics = loader.metrics
        # The loader counts whole rows, which every cp peer of a micro batch holds: cp rank 0's.
        lead = topo.cp_rank == 0
        mine["masked"] = metrics["stale_masked_tokens"] if lead else 0
        lags = {k[7:]: int(v) for k, v in metrics.items() if k.startswith("tokens_lag")}
        mine["lags"] = lags if lead else {}
        if before is not None:
            before |= {"sampler": record.sampler.tolist(), "replay": record.trainer.tolist()}
            before |= {"kept": record.kept.tolist(), "rank": rank, "dp_rank": topo.dp_rank}
            mine["numerics"] = before | {"cp_rank": topo.cp_rank}
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
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
                "samples": sorted(f for g in gathered for f in g["samples"]),
                "digest": weights_digest(full),
                "stale_dropped": int(metrics["stale_dropped"]),
                "stale_masked_tokens": sum(int(g["masked"]) for g in gathered),
                "tokens_by_lag": lag_totals(g["lags"] for g in gathered),
                "partial": [p for g in gathered for p in g["partial"]],
            }
        )
        last = step + 1 == args.steps
        if args.checkpoint_every and ((step + 1) % args.checkpoint_every == 0 or last):
            path = checkpoint_path(args.checkpoints, step + 1)
            if rank == 0:  # beside the DCP files, before them: .metadata comes last
                path.mkdir(parents=True, exist_ok=True)
                (path / "trainer.json").write_text(json.dumps(result))
            save_checkpoint(path, model, optimizer, loader)
            if args.progress:  # after the checkpoint is complete
                announce(args, model, step + 1, path)
    loader.close()  # the workers end now, not at interpreter exit
    if rank == 0:
        args.out.write_text(json.dumps(result))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rollfeed.demo.trainer")
    ap.add_argument("--model-dir", type=Path, required=True, help="the weights of step 0")
    ap.add_argument("--workdir", type=Path, help="steps/, payload/, checkpoints/ under it")
    ap.add_argument("--steps-dir", type=Path, help="the step files (default WORKDIR/steps)")
    ap.add_argument("--root", type=Path, help="the payload root (default WORKDIR/payload)")
    ap.add_argument("--checkpoints", type=Path, help="default WORKDIR/checkpoints")
    ap.add_argument("--out", type=Path, help="the run's record (default WORKDIR/trainer.json)")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="train up to this step (exclusive)")
    ap.add_argument("--from", dest="start", type=int, help="start at this step's checkpoint")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--clip-eps", type=float, default=0.2, help="0: no clip")
    ap.add_argument("--correction", choices=sorted(CORRECTIONS), default="tis")
    ap.add_argument(
        "--centering", action=argparse.BooleanOptionalAction, default=True, help="score centering"
    )
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--workers", type=int, default=1, help="loader worker processes")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="0: no checkpoints")
    ap.add_argument("--resume", action="store_true", help="from the newest checkpoint, if any")
    ap.add_argument(
        "--progress", action="store_true", help="write the progress file after each checkpoint"
    )
    ap.add_argument("--step-timeout", type=float, default=600.0, help="wait for a step file")
    ap.add_argument(
        "--weights", type=Path, help="with --progress: write the weights for the server here"
    )
    ap.add_argument("--max-staleness", type=int, help="the loader's bound (default: none)")
    ap.add_argument("--on-stale", choices=("drop", "mask", "error"), default="error")
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
