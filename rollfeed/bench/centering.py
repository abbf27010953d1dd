"""Score centering's added time on top of fused support scoring, forward + backward.

``python -m rollfeed.bench centering [--vocab 151936] [--rows 16384] [--hidden 512]
[--repeats 5] [--device cpu|cuda]``

Inputs: fp32 hidden states ``[N, H]``, an LM-head weight ``[V, H]`` and heavy-tailed kept sets
as :class:`~rollfeed.collate.RaggedRows` (45% singletons, the rest ``2·U^(−1/1.1)`` clipped at
2048: mean ~8, p99 ~80, a few rows in the hundreds or thousands), the label first, with sampler
mask logprobs (a softmax over each kept set, times 0.95). Three variants, each forward + backward
with gradients for hidden and weight:

- ``fused``: :func:`rollfeed.models.fused_support_logprobs`, the label logprobs' ``Σ u·logp``
  (the baseline);
- ``kept``: the same scorer asked for ``support_logprobs`` too, loss ``Σ u·logp`` (the scorer's own
  cost of returning every kept id's logprob);
- ``centered``: ``kept`` plus :func:`rollfeed.objectives.support_distribution` and
  :func:`rollfeed.objectives.policy_loss` with TIS (cap 2) and score centering, loss
  ``Σ ℓ_t`` (the centering term's added time end to end is ``centered − kept``, the scorer's
  backward of the kept logprobs' gradient included);
- ``objective``: the objectives alone, forward + backward, on the kept logprobs as a leaf (their
  own share of ``centered − kept``).

The variants run interleaved in one process, ``--repeats`` rounds, and each prints its best
(a shared machine's load only ever adds time); the added times are printed in ms and as a
fraction of ``fused``. With ``--device cuda`` each run is timed between two
``torch.cuda.synchronize()`` calls.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from rollfeed.collate import RaggedRows
from rollfeed.models import fused_support_logprobs
from rollfeed.objectives import ScoreCentering, TruncatedIS, policy_loss, support_distribution

VARIANTS = ("fused", "kept", "centered", "objective")


def _inputs(rows: int, vocab: int, hidden: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g).mul_(2.0 / hidden**0.5)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    tail = (2 * torch.rand(rows, generator=g).pow(-1 / 1.1)).long().clamp(2, 2048)
    sizes = torch.where(torch.rand(rows, generator=g) < 0.45, 1, tail)
    offsets = torch.zeros(rows + 1, dtype=torch.int64)
    torch.cumsum(sizes, 0, out=offsets[1:])
    nnz = int(offsets[-1])
    row = torch.repeat_interleave(torch.arange(rows), sizes)
    slot = torch.arange(nnz) - offsets[row]
    # Distinct ids per row, the label first: the label plus increasing offsets (mod V).
    step = torch.randint(1, max(2, vocab // 4096), (nnz,), generator=g)
    step[slot == 0] = 0
    run = torch.cumsum(step, 0)
    ids = (labels[row] + run - run[offsets[row]]) % vocab
    z = torch.randn(nnz, generator=g, dtype=torch.float64)
    lse = torch.zeros(rows, dtype=torch.float64).index_add(0, row, z.exp()).log()
    mask_lp = (z - lse[row] + torch.log(torch.tensor(0.95, dtype=torch.float64))).float()
    out = {
        "hidden": h.to(device).requires_grad_(),
        "weight": w.to(device).requires_grad_(),
        "labels": labels.to(device),
        "support": RaggedRows(offsets, ids).to(device),
        "mask": RaggedRows(offsets, mask_lp).to(device),
        "up": torch.randn(rows, generator=g).to(device),
        "advantages": torch.randn(rows, generator=g).to(device),
        "sizes": sizes,
    }
    return out


def _run(variant: str, x: dict) -> None:
    if variant == "objective":
        logprobs, kept = x["leaf_logprobs"], x["leaf_kept"]
    else:
        scores = fused_support_logprobs(
            x["hidden"],
            x["weight"],
            x["labels"],
            x["support"],
            return_support_logprobs=variant != "fused",
        )
        logprobs, kept = scores.logprobs, scores.support_logprobs
    if variant in ("fused", "kept"):
        (logprobs * x["up"]).sum().backward()
        return
    n = x["labels"].numel()
    dist = support_distribution(
        x["support"],
        kept,
        x["mask"],
        labels=x["labels"],
        loss_mask=torch.ones(n, dtype=torch.bool, device=x["labels"].device),
        inference_logprobs=torch.zeros(n, device=x["labels"].device),
    )
    weight = TruncatedIS(cap=2.0)
    terms = policy_loss(dist, logprobs, x["advantages"], weight=weight, centering=ScoreCentering())
    terms.loss.sum().backward()


def _time(variant: str, x: dict, device: torch.device) -> float:
    x["hidden"].grad = x["weight"].grad = None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    _run(variant, x)
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m rollfeed.bench centering")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench centering --device cuda: no CUDA device; drop --device")
    device = torch.device(args.device)
    x = _inputs(args.rows, args.vocab, args.hidden, device)
    sizes = x.pop("sizes").double()
    with torch.no_grad():
        scores = fused_support_logprobs(
            x["hidden"], x["weight"], x["labels"], x["support"], return_support_logprobs=True
        )
    x["leaf_logprobs"] = scores.logprobs.clone().requires_grad_()
    x["leaf_kept"] = scores.support_logprobs.with_values(
        scores.support_logprobs.values.clone().requires_grad_()
    )
    for variant in VARIANTS:  # warm-up: one-time costs are nobody's
        _time(variant, x, device)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            times[variant].append(_time(variant, x, device))
    best = {v: min(t) * 1e3 for v, t in times.items()}
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"centering: V={args.vocab} N={args.rows} H={args.hidden} fp32 on {where}, kept sets "
        f"mean {float(sizes.mean()):.1f}, p99 {float(sizes.quantile(0.99)):.0f}, max "
        f"{int(sizes.max())}, singletons {100 * float((sizes == 1).double().mean()):.0f}%, "
        f"{int(sizes.sum())} kept ids; forward+backward, best of {args.repeats} interleaved"
    )
    base = best["fused"]
    added = best["centered"] - best["kept"]
    print(
        f"  fused {base:9.1f} ms | + kept logprobs {best['kept'] - base:+8.1f} ms "
        f"({(best['kept'] - base) / base:+.1%}) | + centering {added:+8.1f} ms "
        f"({added / base:+.1%} of fused; goal <= 15%) | the objectives alone "
        f"{best['objective']:7.1f} ms ({best['objective'] / base:.1%} of fused)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
