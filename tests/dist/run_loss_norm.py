"""The step's loss over dp 2 x cp 2 (4 gloo ranks) equals one process over the whole step.

Rank 0 writes one step (samples with varied loss masks, some longer than ``seq_len`` and cut,
some left without a loss token) with its index; every rank loads it through its own loader
(``Topology.from_mesh`` of a ``(dp, cp)`` mesh, zigzag rows). A tiny float64 Qwen3 is sharded
with FSDP2 over the 4 ranks (each decoder layer and the root) and its gradient reduction made a
sum (:func:`rollfeed.models.sum_gradients`); the scorer runs Ulysses over ``cp``. For each
aggregation mode, each rank adds up :func:`rollfeed.objectives.aggregate` of its micro batches'
terms ``ℓ = -A · log p`` (one backward per micro batch, no collective for the normalisation):

- the loss summed over every rank and micro batch equals the single-process loss over the whole
  (truncated) step, its denominators counted from the samples' own masks;
- the reduced gradients equal the single-process gradients (each rank its FSDP shard: dim-0
  chunk ``rank`` of the full tensor; compared locally, no DTensor gather, whose functional
  collectives would leave the default group referenced past teardown).

Rank 0 prints each mode's largest differences. Also DDP: with :func:`sum_gradients` a 4-rank
``DistributedDataParallel`` gives the sum of the ranks' gradients (its default is their mean).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from rollfeed.collate import PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.loaders import LoaderConfig, RolloutDataset, Topology, build_dataloader
from rollfeed.loaders.step_files import write_step_file
from rollfeed.models import PolicyScorer, sum_gradients
from rollfeed.objectives import AGGREGATIONS, aggregate
from tests.collate.loss_samples import samples_for
from tests.dist.launch import run_rank
from tests.dist.run_train_resume import release_meshes
from tests.models.tiny import tiny_qwen3

SEQ_LEN = 32
SEED = 7
TOL = 1e-10


def terms_of(scorer: PolicyScorer, mb) -> torch.Tensor:
    """``[N]``: ``-A · log p`` at this rank's positions (full-vocabulary logprobs)."""
    out = scorer.score(mb, fallback_unsupported=True)
    return -mb.advantages.double() * out.logprobs[mb.positions]


def reference(samples, mode: str) -> tuple[float, dict[str, torch.Tensor], int]:
    """The loss over the whole step in one process (an unsharded copy, one rank, cp 1), its
    denominators counted from the micro batches' own ``loss_mask``; and its gradients."""
    model = tiny_qwen3(seed=SEED)
    scorer = PolicyScorer(model)
    plan = prepare_batch(samples, PlanConfig(seq_len=SEQ_LEN), dp_size=1)
    sums = torch.zeros(len(samples), dtype=torch.float64)
    counts = torch.zeros(len(samples), dtype=torch.float64)
    for micro in plan[0]:
        mb = to_tensor_micro_batch(micro, cp_rank=0)
        terms = torch.where(mb.loss_mask, terms_of(scorer, mb), 0.0)
        slot = torch.searchsorted(mb.cu_seqlens.long(), mb.positions, right=True) - 1
        owner = torch.tensor(micro.indices + (len(samples),) * 0, dtype=torch.int64)
        keep = slot < len(micro.indices)
        sums = sums.index_add(0, owner[slot[keep]], terms[keep])
        counts = counts.index_add(0, owner[slot[keep]], mb.loss_mask[keep].double())
    tokens, seqs = int(counts.sum()), int((counts > 0).sum())
    if mode == "token_mean":
        loss = sums.sum() / tokens
    elif mode == "seq_mean_token_sum":
        loss = sums.sum() / seqs
    else:
        loss = (sums / counts.clamp_min(1)).sum() / seqs
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, tokens


def check_fsdp(samples, steps: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    fsdp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_cp",))
    topology = Topology.from_mesh(mesh)
    model = tiny_qwen3(seed=SEED)
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    sum_gradients(model)
    scorer = PolicyScorer.from_mesh(model, mesh)
    config = LoaderConfig(plan=PlanConfig(seq_len=SEQ_LEN, cp_layout="zigzag"))
    loader = build_dataloader(RolloutDataset.from_step_dir(steps), topology, config, root=None)
    batches = list(loader)
    metrics = loader.metrics
    loader.close()
    assert metrics["truncated"] > 0 and metrics["samples_without_loss"] > 0, metrics
    for mode in AGGREGATIONS:
        model.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        for mb in batches:
            share = aggregate(terms_of(scorer, mb), mb, mode=mode)
            share.backward()
            total += share.detach()
        dist.all_reduce(total)
        want, want_grads, tokens = reference(samples, mode)
        assert batches[0].step_counts.loss_tokens == tokens == metrics["loss_tokens"]
        worst = torch.zeros((), dtype=torch.float64)
        for name, p in model.named_parameters():
            shard = torch.chunk(want_grads[name], world, dim=0)[rank]
            local = p.grad.to_local()
            assert local.shape == shard.shape, (name, local.shape, shard.shape)
            if local.numel():
                worst = torch.maximum(worst, (local - shard).abs().max())
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if rank == 0:
            loss_diff, grad_diff = abs(total.item() - want), worst.item()
            big = max(g.abs().max().item() for g in want_grads.values())
            print(
                f"mode {mode} loss {total.item():.17g} single {want:.17g} loss_diff "
                f"{loss_diff:.3e} grad_diff {grad_diff:.3e} grad_max {big:.3e}",
                flush=True,
            )
            assert loss_diff < TOL and grad_diff < TOL and big > 1e-3, mode
    del scorer, model, mesh, fsdp_mesh


def check_ddp() -> None:
    """Each rank's loss is its own part of a sum: the gradient is the sum of theirs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    local = torch.nn.Linear(3, 2, dtype=torch.float64)
    inputs = [
        torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
        for r in range(world)
    ]
    want = [torch.zeros_like(p) for p in local.parameters()]
    for r, x in enumerate(inputs):
        grads = torch.autograd.grad((local(x) ** 2).sum() * (r + 1), list(local.parameters()))
        want = [w + g for w, g in zip(want, grads, strict=True)]
    for summed in (False, True):
        model = torch.nn.Linear(3, 2, dtype=torch.float64)
        model.load_state_dict(local.state_dict())
        ddp = DistributedDataParallel(model)
        if summed:
            sum_gradients(ddp)
        ((ddp(inputs[rank]) ** 2).sum() * (rank + 1)).backward()
        scale = 1.0 if summed else 1.0 / world  # DDP's own reduction: the mean
        diff = max(
            (p.grad - w * scale).abs().max().item()
            for p, w in zip(model.parameters(), want, strict=True)
        )
        assert diff < TOL, (summed, diff)
        if rank == 0:
            print(
                f"ddp {'sum_gradients' if summed else 'default mean'} diff {diff:.3e}", flush=True
            )
        del ddp


def main(workdir: Path) -> None:
    samples = samples_for(SEED, 12, SEQ_LEN)
    steps = workdir / "steps"
    if dist.get_rank() == 0:
        write_step_file(steps, 0, samples)
    dist.barrier()
    check_fsdp(samples, steps)
    release_meshes()  # before run_rank destroys the groups (see the function)
    check_ddp()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, required=True)
    run_rank(main, ap.parse_args().workdir)
