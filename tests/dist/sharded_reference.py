"""The single-process float64 reference of the sharded-scoring tests, and what they share with it.

The reference trains an unsharded copy of the model on the union of every DP rank's samples: a
stock HF forward per sample (sdpa attention, full logits, the support formula written out by
:func:`tests.dist.policy_cases.reference`), the loss ``Σ_tokens ℓ / (global count of loss tokens)``
with ``ℓ = -advantage · logprob - ENTROPY_COEF · entropy`` on the rows that carry a loss and a
recorded support, and :data:`ADAMW` steps. It keeps, per step, the logprobs, entropies and valid
mask in sample coordinates (``uid -> [T - 1]``, entry ``j`` scores token ``j + 1``), the gradient
of every parameter at step 0 and the parameters after the last step.

AdamW's ``eps`` is 1e-6 rather than 1e-8: near a zero gradient the update ``lr · g / (|g| + eps)``
amplifies a rounding difference of the gradient by ``lr / eps``; at 1e-3 / 1e-6 a 1e-15 difference
moves a parameter by 1e-12, inside the tolerance, while every parameter still moves by ~1e-3.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rollfeed.collate import MicroBatch, PlanConfig, Sample, prepare_batch, to_tensor_micro_batch
from tests.dist.policy_cases import reference, stock_forward

ENTROPY_COEF = 0.1
ADAMW = {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.1}
STEPS = 2


def loss_sum(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    valid: torch.Tensor,
    loss_mask: torch.Tensor,
    advantages: torch.Tensor,
) -> torch.Tensor:
    """``Σ_rows ℓ`` over the rows that carry a loss and a recorded support; all ``[S]``."""
    keep = (valid & loss_mask).to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)
    return (keep * (-adv * logprobs - ENTROPY_COEF * entropy)).sum()


def loss_tokens(mb: MicroBatch) -> int:
    """Rows of ``mb`` that carry a loss and a recorded support (the loss's denominator terms)."""
    whole = whole_row(mb)
    support = whole.fields.get("sampling_mask")
    if support is None:
        return 0
    return int((whole.loss_mask & (support.lengths() > 0)).sum())  # a row holds its label


def whole_row(mb: MicroBatch):
    """``mb``'s tensors over the whole row in canonical order (cp 1): the ``[S]`` loss mask and
    advantages every cp rank applies to the gathered scores."""
    one = PlanConfig(
        seq_len=mb.config.seq_len, pad_to_multiple_of=mb.config.pad, fields=mb.config.fields
    )
    return to_tensor_micro_batch(dataclasses.replace(mb, config=one), cp_rank=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Reference:
    """``scores[step][uid] = (logprobs, entropy, valid)``, each ``[T - 1]``; ``grads`` at step 0
    and ``params`` after the last step by parameter name; ``count``: the loss's denominator."""

    scores: list[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    count: int


def train_reference(
    model: torch.nn.Module, samples: list[Sample], *, forward=stock_forward
) -> Reference:
    """Train ``model`` (sdpa attention, float64, unsharded) for :data:`STEPS` AdamW steps on all
    ``samples`` at once; see the module doc. ``forward``: how one sample runs alone (a hybrid
    model: through rollfeed's layers, :func:`tests.models.hybrid_cases.alone_forward`)."""
    total = sum(len(s.token_ids) for s in samples)
    (mb,) = prepare_batch(samples, PlanConfig(seq_len=-(-total // 8) * 8), dp_size=1)[0]
    whole = whole_row(mb)
    count = loss_tokens(mb)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    scores, grads = [], {}
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        logp, ent, valid = reference(model, mb, forward=forward)
        loss = loss_sum(logp, ent, valid, whole.loss_mask, whole.advantages) / count
        loss.backward()
        per_sample = {}
        for sample, start in zip(mb.samples, mb.starts, strict=True):
            rows = slice(start, start + len(sample.token_ids) - 1)
            per_sample[sample.uid] = (
                logp[rows].detach(),
                ent[rows].detach(),
                valid[rows],
            )
        scores.append(per_sample)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            # Every parameter's check must mean something: each gets a gradient far above the
            # tolerance, so a gradient off by any factor fails.
            flat = [n for n, g in grads.items() if g.abs().max() < 1e-6]
            assert not flat, f"parameters without a real gradient in the reference: {flat}"
        optimizer.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return Reference(scores=scores, grads=grads, params=params, count=count)
