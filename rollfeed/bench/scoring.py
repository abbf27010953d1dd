"""Fused support scoring vs full-vocab ``log_softmax`` + gather: time, peak memory, error.

``python -m rollfeed.bench scoring [--vocab 151936 32000 262144] [--rows 2048] [--hidden 512]
[--width 32] [--repeats 2] [--device cpu|cuda]``

Both variants start from fp32 hidden states ``[N, H]`` and an LM-head weight ``[V, H]`` and run
forward + backward (gradients for hidden and weight) of ``Σ_n u_n · logp_n``:

- ``full``: ``log_softmax(hidden @ weight.T).gather(labels)``, the full-vocab trainer;
- ``fused``: :func:`rollfeed.models.fused_support_logprobs` over a recorded support of width W
  (45% singletons, a heavy tail of larger sets, the label always a member).

Each variant runs in its own subprocess, so one variant's allocations cannot hide in another's peak.
Peak memory is ``ru_maxrss`` (the process's resident-set high-water mark) at the end, minus the
resident set right after the inputs are allocated and a tiny warm-up run of the same variant
(``/proc/self/statm``; one-time library costs such as thread pools are not the scorer's), minus
one weight-sized gradient buffer (``V·H·4`` bytes) that every variant must produce. What remains
is the scorer's own temporaries (logits, softmax, their gradients; or chunks, dots and the hidden
gradient). PyTorch's CPU allocator does not cache, so freed temporaries are returned and the
high-water mark is what the variant really needed at once. Time is the best of ``--repeats``
runs. The error is the largest absolute difference of the logprobs from a float64 evaluation of
the same quantity, computed after the measurements.

With ``--device cuda`` the same inputs (drawn on the CPU, then moved) live on the GPU; each run is
timed between two ``torch.cuda.synchronize()`` calls, and the peak is
``torch.cuda.max_memory_allocated`` (reset after the inputs and the warm-up exist) minus what was
allocated then, minus the same weight-sized gradient: the caching allocator's reserved but free
blocks are not counted. The ratios printed are the same as on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from rollfeed.bench._process import peak_bytes, resident_bytes, run_variant
from rollfeed.models import fused_support_logprobs

VARIANTS = ("full", "fused")


def _inputs(rows: int, vocab: int, hidden: int, width: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g).mul_(2.0 / hidden**0.5)  # in place: no transient
    labels = torch.randint(0, vocab, (rows,), generator=g)
    # 45% singletons; the rest log-uniform in [2, width] (mean ~4.5 at width 32).
    u = torch.rand(rows, generator=g)
    sizes = torch.where(
        u < 0.45,
        torch.ones(rows),
        torch.exp(torch.rand(rows, generator=g) * torch.log(torch.tensor(width / 2.0))) * 2,
    ).long()
    sizes = sizes.clamp(1, width)
    # Distinct ids per row, the label first: the label plus increasing random offsets (mod V).
    steps = torch.randint(1, max(2, vocab // (2 * width)), (rows, width), generator=g)
    steps[:, 0] = 0
    support = (labels[:, None] + steps.cumsum(1)) % vocab
    support[torch.arange(width)[None, :] >= sizes[:, None]] = -1
    return {"hidden": h, "weight": w, "labels": labels, "support": support}


def _run(variant: str, x: dict[str, torch.Tensor], up: torch.Tensor) -> torch.Tensor:
    h, w = x["hidden"], x["weight"]
    if variant == "full":
        logp = torch.log_softmax(h @ w.T, -1).gather(1, x["labels"][:, None]).squeeze(1)
    else:
        scores = fused_support_logprobs(h, w, x["labels"], x["support"], missing_label="full_vocab")
        logp = scores.logprobs
    (logp * up).sum().backward()
    return logp.detach()


def _reference(variant: str, x: dict[str, torch.Tensor]) -> torch.Tensor:
    """Float64 logprobs, by a different route than the variant (row chunks / masked logsumexp)."""
    h, w = x["hidden"].double(), x["weight"].double()
    if variant == "full":
        out = []
        for s in range(0, h.shape[0], 128):
            logits = h[s : s + 128] @ w.T
            lab = x["labels"][s : s + 128, None]
            out.append((logits.gather(1, lab) - logits.logsumexp(-1, keepdim=True)).squeeze(1))
        return torch.cat(out)
    support = x["support"]
    cand = torch.einsum("nh,nkh->nk", h, w[support.clamp(min=0)])
    cand = cand.masked_fill(support < 0, float("-inf"))
    label = (h * w[x["labels"]]).sum(-1)
    return label - cand.logsumexp(-1)


def _on(device: torch.device, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inputs moved to ``device``, hidden and weight as leaves that require grad."""
    out = {k: v.to(device) for k, v in x.items()}
    out["hidden"].requires_grad_()
    out["weight"].requires_grad_()
    return out


def _child(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    x = _on(device, _inputs(args.rows, args.vocab, args.hidden, args.width))
    up = torch.randn(args.rows).to(device)
    # A tiny run first, so one-time costs (kernel selection, thread pools, the CUDA context) are
    # not in the peak.
    _run(args.child, _on(device, _inputs(16, 256, args.hidden, args.width)), up[:16])
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = resident_bytes()
    best = float("inf")
    for _ in range(args.repeats):
        x["hidden"].grad = x["weight"].grad = None
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        logp = _run(args.child, x, up)
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if cuda else peak_bytes()
    extra = peak - base - x["weight"].numel() * 4
    err = (logp.double() - _reference(args.child, x)).abs().max().item()
    print(json.dumps({"seconds": best, "extra_bytes": extra, "max_abs_err": err}))


def _measure(variant: str, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    argv = ["--child", variant, "--vocab", str(vocab), "--rows", str(args.rows)]
    argv += [
        "--hidden",
        str(args.hidden),
        "--width",
        str(args.width),
        "--repeats",
        str(args.repeats),
        "--device",
        args.device,
    ]
    return run_variant("rollfeed.bench.scoring", argv)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m rollfeed.bench scoring")
    p.add_argument("--vocab", type=int, nargs="+", default=[151936, 32000, 262144])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.vocab = args.vocab[0]
        _child(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "bench scoring --device cuda: torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda}); run it on a machine with "
            "a CUDA GPU, or drop --device for the CPU benchmark"
        )
    mib = 2**20
    if args.device == "cuda":
        print(
            f"scoring: N={args.rows} H={args.hidden} W={args.width} fp32 on "
            f"{torch.cuda.get_device_name()} (torch {torch.__version__}), forward+backward, "
            f"best of {args.repeats}; memory = peak allocated above inputs + one weight grad"
        )
    else:
        print(
            f"scoring: N={args.rows} H={args.hidden} W={args.width} fp32, forward+backward, "
            f"best of {args.repeats}; memory = peak above inputs + one weight grad"
        )
    for vocab in args.vocab:
        full, fused = (_measure(v, args, vocab) for v in VARIANTS)
        speed = full["seconds"] / fused["seconds"]
        mem = full["extra_bytes"] / max(fused["extra_bytes"], 1)
        print(
            f"V={vocab:>7}  full {full['seconds'] * 1e3:9.1f} ms "
            f"{full['extra_bytes'] / mib:8.1f} MiB"
            f" err {full['max_abs_err']:.1e} | fused {fused['seconds'] * 1e3:7.1f} ms "
            f"{fused['extra_bytes'] / mib:7.1f} MiB err {fused['max_abs_err']:.1e} | "
            f"fused is {speed:6.1f}x faster, {mem:6.1f}x less memory"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
