"""Loss objectives over cp 2 (contiguous and zigzag) and TP 2 equal one process (2 gloo ranks).

cp: a packed row of samples with kept sets and mask logprobs (some ``-inf``, ``-9999`` and lower
slots, one sample without mask logprobs, left uncentered by name) is planned for cp 2; each rank
scores its window with the :class:`~rollfeed.models.PolicyScorer` over the cp group, takes its rows
(:func:`~rollfeed.objectives.micro_batch_rows`) and computes the policy terms with sequence
weights over the cp group. Its per-id logprobs, per-token loss, centering, sequence and applied
weights equal the single-rank result at its positions, the metric sums added over the ranks equal
the single-rank sums, ``policy_loss`` makes exactly one all-reduce, and the parameter gradients
summed over the cp group equal the single-rank gradients. TP: each rank holds an uneven vocabulary
shard of ``[N, V]`` logits, scores kept logprobs vocabulary-parallel and computes the same terms;
values, metrics and its shard of the logits gradient equal one process. Float64, 1e-10.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from rollfeed.collate import (
    PlanConfig,
    Sample,
    prepare_batch,
    to_tensor_micro_batch,
)
from rollfeed.models import CPGroup, PolicyScorer, support_logprobs
from rollfeed.objectives import (
    MaskedIS,
    PPOClip,
    ScoreCentering,
    SequenceWeight,
    TruncatedIS,
    Unweighted,
    micro_batch_rows,
    policy_loss,
    support_distribution,
)
from tests.dist.launch import run_rank
from tests.models.tiny import VOCAB, tiny_qwen3
from tests.objectives.cases import CU_SEQLENS, V, make_case, scored

TOL = 1e-10
LENGTHS = [7, 10, 3, 9]
CONFIGS = {
    "tis+seq-sum-cap": dict(
        weight=TruncatedIS(cap=2.0),
        sequence=SequenceWeight(statistic="sum", cap=3.0),
        centering=ScoreCentering(weight=TruncatedIS(cap=2.0), missing="skip"),
    ),
    "clip+mis+seq-mean-band+veto": dict(
        weight=MaskedIS(low=0.2, high=5.0),
        clip=PPOClip(eps_low=0.2),
        sequence=SequenceWeight(statistic="mean", band=(0.3, 3.0), veto=0.01),
        centering=ScoreCentering(weight=Unweighted(), missing="skip"),
    ),
}
CALLS: list[tuple[int, ...]] = []
_all_reduce = dist.all_reduce


def _counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):  # type: ignore[no-untyped-def]
    CALLS.append(tuple(tensor.shape))
    return _all_reduce(tensor, op=op, group=group, async_op=async_op)


def make_samples(seed: int) -> list[Sample]:
    """Completion tokens with kept sets (the sampled token and 0-4 others) and mask logprobs."""
    rng = np.random.default_rng(seed)
    samples = []
    for i, T in enumerate(LENGTHS):
        ids = rng.integers(0, VOCAB, T)
        prompt = int(rng.integers(1, max(2, T // 2)))
        counts = np.zeros(T, np.int64)
        values: list[int] = []
        logprobs: list[float] = []
        for t in range(prompt, T):
            extra = rng.choice(np.setdiff1d(np.arange(VOCAB), [ids[t]]), rng.integers(0, 5), False)
            row = [int(ids[t]), *map(int, extra)]
            lps = list(np.log(rng.dirichlet(np.ones(len(row)))) + np.log(0.95))
            if len(row) > 2:  # an invalid slot: -inf, vLLM's JSON clamp, or below it
                lps[-1] = [-np.inf, -9999.0, -12345.0][t % 3]
            counts[t] = len(row)
            values += row
            logprobs += lps
        fields: dict = {"sampling_mask": (counts, np.asarray(values, np.int32))}
        if i != 2:  # sample 2 carries no mask logprobs
            fields["sampling_mask_logprobs"] = (counts, np.asarray(logprobs, np.float32))
        samples.append(
            Sample(
                ids,
                loss_mask=np.arange(T) >= prompt,
                advantages=rng.standard_normal(T).astype(np.float32),
                inference_logprobs=-rng.random(T, dtype=np.float32) - 0.5,
                temperatures=np.ones(T, np.float32),
                fields=fields,
                uid=f"s{i}",
            )
        )
    return samples


def scores_of(scorer: PolicyScorer, tmb):  # type: ignore[no-untyped-def]
    out = scorer.score(tmb, return_support_logprobs=True)
    support, mask = micro_batch_rows(tmb)
    kept = support_distribution(
        support,
        out.support_logprobs,
        mask,
        labels=tmb.labels,
        loss_mask=tmb.loss_mask,
        inference_logprobs=tmb.inference_logprobs.double(),
    )
    return out, kept


def terms_of(out, kept, tmb, config: dict, group=None):  # type: ignore[no-untyped-def]
    CALLS.clear()
    terms = policy_loss(
        kept,
        out.logprobs[tmb.positions],
        tmb.advantages.double(),
        positions=tmb.positions,
        cu_seqlens=tmb.cu_seqlens,
        group=group,
        **config,
    )
    return terms, list(CALLS)


def grads(loss: torch.Tensor, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True, allow_unused=True)
    return {n: g for (n, _), g in zip(named, got, strict=True) if g is not None}


def run_cp(layout: str, cp: CPGroup, single: PolicyScorer, scorer: PolicyScorer) -> None:
    (mb,) = prepare_batch(
        make_samples(5), PlanConfig(seq_len=48, cp_size=2, cp_layout=layout), dp_size=1
    )[0]
    one = dataclasses.replace(mb.config, cp_size=1, cp_layout="contiguous")
    whole = to_tensor_micro_batch(dataclasses.replace(mb, config=one), cp_rank=0)
    tmb = to_tensor_micro_batch(mb, cp_rank=cp.rank)
    coef = torch.linspace(0.5, 1.5, mb.length, dtype=torch.float64)
    out1, kept1 = scores_of(single, whole)
    out, kept = scores_of(scorer, tmb)
    pos = tmb.positions
    want_kept = out1.support_logprobs.take(pos)
    assert torch.equal(out.support_logprobs.offsets, want_kept.offsets), layout
    torch.testing.assert_close(
        out.support_logprobs.values.detach(), want_kept.values.detach(), atol=TOL, rtol=0
    )
    for name, config in CONFIGS.items():
        where = f"{layout}/{name}"
        t1, _ = terms_of(out1, kept1, whole, config)
        t, calls = terms_of(out, kept, tmb, config, group=cp.group)
        assert len(calls) == 1, (where, calls)  # the sample sums, nothing else
        for field in ("loss", "centering", "sequence_weight", "weight"):
            got, want = getattr(t, field).detach(), getattr(t1, field).detach()[pos]
            torch.testing.assert_close(got, want, atol=TOL, rtol=0, msg=f"{where} {field}")
        assert int((t1.centering != 0).sum()) > 5 and int((t1.sequence_weight == 0).sum()) > 0
        assert int(t1.metrics["slots_invalid"]) > 0 and int(t1.metrics["rows_no_mask_logprobs"])
        names = sorted(t.metrics)
        summed = torch.stack([t.metrics[k].double() for k in names])
        dist.all_reduce(summed, group=cp.group)
        want = torch.stack([t1.metrics[k].double() for k in names])
        torch.testing.assert_close(summed, want, atol=TOL, rtol=0, msg=f"{where} metrics")
        g1 = grads((t1.loss * coef).sum(), single.model)
        g = grads((t.loss * coef[pos]).sum(), scorer.model)
        assert set(g) == set(g1), where
        worst = 0.0
        for pname, grad in g.items():
            dist.all_reduce(grad, group=cp.group)
            worst = max(worst, (grad - g1[pname]).abs().max().item())
        assert worst < TOL, (where, worst)
        print(f"rank {cp.rank} cp {where} ok", flush=True)


def run_tp(group, rank: int, size: int) -> None:  # type: ignore[no-untyped-def]
    case = make_case(seed=13)
    start, stop = (0, 4) if rank == 0 else (4, V)  # uneven shards
    shard = case["logits"].detach()[:, start:stop].clone().requires_grad_()
    bounds = dict(positions=torch.arange(len(case["rows"])), cu_seqlens=torch.tensor(CU_SEQLENS))
    for name, config in CONFIGS.items():
        out1, kept1 = scored(case)
        t1 = policy_loss(kept1, out1.logprobs, case["advantages"], **bounds, **config)
        coef = torch.linspace(0.5, 1.5, t1.loss.numel(), dtype=torch.float64)
        (g1,) = torch.autograd.grad((t1.loss * coef).sum(), case["logits"])
        out = support_logprobs(
            shard,
            case["labels"],
            case["support"],
            return_support_logprobs=True,
            fallback_mask=case["fallback"],
            missing_label="full_vocab",
            tp_group=group,
            vocab_start=start,
            vocab_size=V,
        )
        kept = support_distribution(
            case["support"],
            out.support_logprobs,
            case["mask"],
            labels=case["labels"],
            loss_mask=case["loss_mask"],
            inference_logprobs=case["inference"],
        )
        t = policy_loss(kept, out.logprobs, case["advantages"], **bounds, **config)
        (g,) = torch.autograd.grad((t.loss * coef).sum(), shard)
        torch.testing.assert_close(
            out.support_logprobs.values.detach(),
            out1.support_logprobs.values.detach(),
            atol=TOL,
            rtol=0,
        )
        for field in ("loss", "centering", "sequence_weight", "weight"):
            torch.testing.assert_close(
                getattr(t, field).detach(), getattr(t1, field).detach(), atol=TOL, rtol=0
            )
        for k, v in t1.metrics.items():
            torch.testing.assert_close(t.metrics[k], v, atol=TOL, rtol=0, msg=f"tp {name} {k}")
        torch.testing.assert_close(g, g1[:, start:stop], atol=TOL, rtol=0)
        assert g1.abs().max() > 1e-3
        print(f"rank {rank}/{size} tp {name} shard [{start}, {stop}) ok", flush=True)


def main() -> None:
    dist.all_reduce = _counting_all_reduce  # type: ignore[assignment]
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    cp = CPGroup(group=dist.group.WORLD, rank=rank, size=2)
    # One scorer of each kind for both layouts (the layout comes with the micro batch).
    single = PolicyScorer(tiny_qwen3(seed=21))
    scorer = PolicyScorer(tiny_qwen3(seed=21), cp=cp)
    for layout in ("contiguous", "zigzag"):
        run_cp(layout, cp, single, scorer)
    run_tp(dist.group.WORLD, rank, world)


if __name__ == "__main__":
    run_rank(main)
