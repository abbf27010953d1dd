"""The demo's training step: a clipped importance-ratio loss, AdamW under FSDP2, DCP checkpoints.

rollfeed reads and scores; this module is the few lines a trainer adds on top, kept in the demo.

**Loss.** :mod:`rollfeed.demo.objective`: per loss-bearing token the PPO clipped surrogate, a
token-level correction and score centering, each a flag, from the support-conditioned logprobs
(:meth:`~rollfeed.models.PolicyScorer.score`, the kept ids' too) and the sampler's mask logprobs.
The step's loss is ``Σ ℓ / N`` over every loss token of every rank, ``N`` the step's count, which
every micro batch carries (:func:`rollfeed.objectives.aggregate`, ``token_mean``; planned from the
step index on every rank, no collective), so the loss does not depend on how tokens fall on
ranks. The objectives' mismatch sums (:func:`rollfeed.objectives.finish_metrics`) are added over
every rank once per step.

**Gradients.** The model is sharded with FSDP2 (``fully_shard``, each decoder layer and the root)
over the flattened ``dp × cp`` mesh. A cp peer holds part of every token's gradient (attention
mixes its shard with its peers'), a dp peer other tokens: each rank's loss is its own tokens' part
of the global sum, so the gradient is the SUM over dp and cp (:func:`rollfeed.models.sum_gradients`;
FSDP's default would average). ``N`` already normalises.

**Checkpoint.** ``torch.distributed.checkpoint`` (DCP) saves the model and AdamW state as sharded
state dicts (``get_state_dict``), and each rank's loader position (``RolloutLoader.state_dict``)
under its own key, as torchtitan keys its data loaders by rank. The loader's step counts finished
optimizer steps (one loader pass per step). ``load_checkpoint`` restores all three in place
(``set_state_dict``), or the model and AdamW only. A run that resumes from the checkpoint of step
``k`` continues bitwise as if never stopped: the same batches, weights and optimizer moments.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from rollfeed.collate import TensorMicroBatch
from rollfeed.demo.objective import DemoObjective
from rollfeed.loaders import RolloutLoader
from rollfeed.models import PolicyScorer, sum_gradients
from rollfeed.objectives import aggregate, finish_metrics, micro_batch_rows

logger = logging.getLogger(__name__)


def shard_model(model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 over the 1-D data-sharding ``mesh``: each decoder layer, then the root (embedding,
    final norm, LM head). Gradients are summed, not averaged: the loss is already normalised by
    the global count of loss tokens."""
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sum_gradients(model)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTokens:
    """One optimizer step seen from one rank: its own loss tokens, scored before the update.

    ``sampler``, ``trainer``, ``entropy``: ``[n]`` float64 (entropy over the kept set);
    ``kept``: ``[n]`` kept-set sizes; ``loss``: the global loss (the same on every rank);
    ``tokens``: the step's count ``N`` of loss tokens; ``clipped``: this rank's tokens whose ratio
    was clipped;
    ``objective``: the objectives' metrics over every rank
    (:func:`rollfeed.objectives.finish_metrics`); a mean not computed is absent, its name in
    ``objective["not_computed"]``.
    """

    step: int
    loss: float
    tokens: int
    clipped: int
    sampler: torch.Tensor
    trainer: torch.Tensor
    entropy: torch.Tensor
    kept: torch.Tensor
    objective: dict[str, float | list[str]]
    step_s: float


def train_step(
    scorer: PolicyScorer,
    batches: list[TensorMicroBatch],
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    objective: DemoObjective,
) -> StepTokens:
    """One optimizer step on one loader pass's micro batches (see the module doc); collective.

    Every micro batch carries the step's loss-token count (``mb.step_counts``), so each is
    trained on as it comes. Every dp rank has the same number of micro batches (the planner pads
    a short rank with dummies), so FSDP's collectives line up.
    """
    t0 = time.perf_counter()
    loss_sum = torch.zeros((), dtype=torch.float64)
    clipped = 0
    sums: dict[str, torch.Tensor] = {}
    sampler, trainer, entropy, kept = [], [], [], []
    for mb in batches:
        out = scorer.score(mb, return_support_logprobs=True)
        terms = objective.terms(mb, out, cp_group=scorer.cp.group, step=step)
        loss = aggregate(terms.loss, mb, mode="token_mean")
        loss.backward()
        loss_sum += loss.detach().double()
        for name, value in terms.metrics.items():
            sums[name] = sums.get(name, 0) + value.double()
        # Whole-row (canonical) results; each rank takes its own positions, so the cp peers of
        # a micro batch count every token once.
        own = mb.loss_mask
        lp = out.logprobs[mb.positions][own]
        old = mb.inference_logprobs[own]
        with torch.no_grad():
            ratio = torch.exp(lp.detach() - old.to(lp.dtype))
            if objective.clip_eps > 0:
                clipped += int(((ratio - 1).abs() > objective.clip_eps).sum())
        sampler.append(old.double())
        trainer.append(lp.detach().double())
        entropy.append(out.entropy[mb.positions][own].detach().double())
        # Kept-set sizes from the rows, padded or ragged (no ids on a dummy micro batch).
        ids, _ = micro_batch_rows(mb)
        size = torch.zeros(own.numel(), dtype=torch.int64, device=own.device)
        kept.append(size.index_add(0, ids.row_index(), (ids.values >= 0).long())[own])
    optimizer.step()
    optimizer.zero_grad()
    # The loss and the metric sums over every rank in one all-reduce (every rank has micro
    # batches, dummies included, so every rank holds every name).
    names = sorted(sums)
    total_sums = torch.stack([loss_sum, *(sums[k] for k in names)])
    dist.all_reduce(total_sums)
    loss_sum = total_sums[0]
    metrics = finish_metrics(dict(zip(names, total_sums[1:], strict=True)))
    cat = lambda xs, dtype: torch.cat(xs) if xs else torch.zeros(0, dtype=dtype)  # noqa: E731
    return StepTokens(
        step=step,
        loss=float(loss_sum),
        tokens=batches[0].step_counts.loss_tokens,
        clipped=clipped,
        sampler=cat(sampler, torch.float64),
        trainer=cat(trainer, torch.float64),
        entropy=cat(entropy, torch.float64),
        kept=cat(kept, torch.int64),
        objective={k: list(v) if k == "not_computed" else float(v) for k, v in metrics.items()},
        step_s=time.perf_counter() - t0,
    )


def checkpoint_path(directory: Path, step: int) -> Path:
    """``directory/step_000002`` holds the checkpoint taken after 2 optimizer steps."""
    return directory / f"step_{step:06d}"


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint under ``directory`` (DCP writes ``.metadata`` last)."""
    done = sorted(p.parent for p in directory.glob("step_*/.metadata"))
    return done[-1] if done else None


def _loader_key() -> str:
    return f"loader_rank{dist.get_rank()}"


def _state(
    model: nn.Module, optimizer: torch.optim.Optimizer, loader: RolloutLoader | None
) -> dict:
    """What a checkpoint holds: model, optimizer and this rank's loader state."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    return state if loader is None else state | {_loader_key(): loader.state_dict()}


def save_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, loader: RolloutLoader
) -> None:
    """Model, optimizer and this rank's loader state under ``path`` (collective)."""
    dcp.save(_state(model, optimizer, loader), checkpoint_id=path)
    logger.info("checkpoint %s written", path)


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: RolloutLoader | None,
) -> None:
    """Restore what :func:`save_checkpoint` wrote, in place: model and optimizer, and the
    loader's position unless ``loader`` is None (a run that starts its loader at the
    checkpoint's step itself, under any world shape)."""
    state = _state(model, optimizer, loader)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    if loader is not None:
        loader.load_state_dict(state[_loader_key()])
