"""The demo's training step: a clipped importance-ratio loss, AdamW under FSDP2, DCP checkpoints.

rollfeed reads and scores; this module is the few lines a trainer adds on top, kept in the demo.

**Loss.** Per loss-bearing token with trainer logprob ``log p`` (support-conditioned, from
:meth:`~rollfeed.models.PolicyScorer.score`), sampler logprob ``log q`` (``inference_logprobs``)
and advantage ``A``: ``r = exp(log p − log q)`` and the PPO clipped surrogate
``ℓ = −min(r A, clip(r, 1 − ε, 1 + ε) A)`` (Schulman et al., 2017). The step's loss is
``Σ ℓ / N`` over every loss token of every rank, ``N`` the global count (one all-reduce per step),
so the loss does not depend on how tokens fall on ranks. Worked example, ``ε = 0.2``, one rank::

    log p − log q  [0.0, 0.5, -0.5]   A [1.0, 1.0, -2.0]   N 3
    r              [1.0, 1.649, 0.607]
    ℓ              [-1.0, -1.2 (r clipped to 1.2), 1.6 (r clipped to 0.8: -2 * 0.8 is smaller)]
    loss           (-1.0 - 1.2 + 1.6) / 3 = -0.2; d loss / d log p = [-1/3, 0, 0]

**Gradients.** The model is sharded with FSDP2 (``fully_shard``, each decoder layer and the root)
over the flattened ``dp × cp`` mesh. A cp peer holds part of every token's gradient (attention
mixes its shard with its peers'), a dp peer other tokens: each rank's loss is its own tokens' part
of the global sum, so the gradient is the SUM over dp and cp; the gradient divide factor is 1
(FSDP's default would average), reduced with a plain SUM. ``N`` already normalises.

**Checkpoint.** ``torch.distributed.checkpoint`` (DCP) saves the model and AdamW state as sharded
state dicts (``get_state_dict``), and each rank's loader position (``RolloutLoader.state_dict``)
under its own key, as torchtitan keys its data loaders by rank. The loader's step counts finished
optimizer steps (one loader pass per step). ``load_checkpoint`` restores all three in place
(``set_state_dict``) and returns that step. A run that resumes from the checkpoint of step ``k``
continues bitwise as if never stopped: the same batches, weights and optimizer moments.
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
from torch.distributed.fsdp import FSDPModule, fully_shard

from rollfeed.collate import TensorMicroBatch
from rollfeed.loaders import RolloutLoader
from rollfeed.models import PolicyScorer

logger = logging.getLogger(__name__)


def clipped_surrogate(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    total_tokens: int,
    clip_eps: float,
) -> torch.Tensor:
    """``Σ ℓ / total_tokens`` over the given loss tokens (``[n]`` each; see the module doc)."""
    ratio = torch.exp(logprobs - sampler_logprobs.to(logprobs.dtype))
    adv = advantages.to(logprobs.dtype)
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    return -torch.minimum(ratio * adv, clipped * adv).sum() / total_tokens


def shard_model(model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 over the 1-D data-sharding ``mesh``: each decoder layer, then the root (embedding,
    final norm, LM head). Gradients are summed, not averaged: the loss is already normalised by
    the global count of loss tokens."""
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM reduce-scatter: for float32 FSDP would otherwise fold the factor into
            # NCCL's PREMUL_SUM, which gloo lacks.
            module.set_force_sum_reduction_for_comms(True)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTokens:
    """One optimizer step seen from one rank: its own loss tokens, scored before the update.

    ``sampler``, ``trainer``, ``entropy``: ``[n]`` float64 (entropy over the kept set);
    ``kept``: ``[n]`` kept-set sizes; ``loss``: the global loss (the same on every rank);
    ``tokens``: the global count ``N``; ``clipped``: this rank's tokens whose ratio was clipped.
    """

    step: int
    loss: float
    tokens: int
    clipped: int
    sampler: torch.Tensor
    trainer: torch.Tensor
    entropy: torch.Tensor
    kept: torch.Tensor
    step_s: float


def train_step(
    scorer: PolicyScorer,
    batches: list[TensorMicroBatch],
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    clip_eps: float,
) -> StepTokens:
    """One optimizer step on one loader pass's micro batches (see the module doc); collective.

    The pass is read before the call (its micro batches are small): the global token count must
    be known before the first backward. Every dp rank has the same number of micro batches (the
    planner pads a short rank with dummies), so FSDP's collectives line up.
    """
    t0 = time.perf_counter()
    # One all-reduce of the loss-token count (a host sync, once per step).
    count = torch.tensor(sum(int(mb.loss_mask.sum()) for mb in batches), dtype=torch.int64)
    dist.all_reduce(count)
    total = max(int(count), 1)
    loss_sum = torch.zeros((), dtype=torch.float64)
    clipped = 0
    sampler, trainer, entropy, kept = [], [], [], []
    for mb in batches:
        out = scorer.score(mb)
        # Whole-row (canonical) results; each rank takes its own positions, so the cp peers of
        # a micro batch count every token once.
        own = mb.loss_mask
        lp = out.logprobs[mb.positions][own]
        old = mb.inference_logprobs[own]
        loss = clipped_surrogate(lp, old, mb.advantages[own], total_tokens=total, clip_eps=clip_eps)
        loss.backward()
        loss_sum += loss.detach().double()
        with torch.no_grad():
            ratio = torch.exp(lp.detach() - old.to(lp.dtype))
            clipped += int(((ratio - 1).abs() > clip_eps).sum())
        sampler.append(old.double())
        trainer.append(lp.detach().double())
        entropy.append(out.entropy[mb.positions][own].detach().double())
        mask = mb.fields.get("sampling_mask")  # absent on a dummy micro batch
        kept.append((mask >= 0).sum(-1)[own] if mask is not None else own.new_zeros(0).long())
    optimizer.step()
    optimizer.zero_grad()
    dist.all_reduce(loss_sum)
    cat = lambda xs, dtype: torch.cat(xs) if xs else torch.zeros(0, dtype=dtype)  # noqa: E731
    return StepTokens(
        step=step,
        loss=float(loss_sum),
        tokens=int(count),
        clipped=clipped,
        sampler=cat(sampler, torch.float64),
        trainer=cat(trainer, torch.float64),
        entropy=cat(entropy, torch.float64),
        kept=cat(kept, torch.int64),
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


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, loader: RolloutLoader) -> dict:
    """What a checkpoint holds: model, optimizer and this rank's loader state."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, _loader_key(): loader.state_dict()}


def save_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, loader: RolloutLoader
) -> None:
    """Model, optimizer and this rank's loader state under ``path`` (collective)."""
    dcp.save(_state(model, optimizer, loader), checkpoint_id=path)
    logger.info("checkpoint %s written", path)


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, loader: RolloutLoader
) -> int:
    """Restore what :func:`save_checkpoint` wrote, in place; returns the optimizer steps done."""
    state = _state(model, optimizer, loader)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    loader.load_state_dict(state[_loader_key()])
    return loader.state_dict()["step"]
