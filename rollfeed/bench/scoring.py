"""Fused support scoring over a ragged kept set vs its padded form vs the full vocabulary.

``python -m rollfeed.bench scoring [--rows 16384] [--vocab 151936] [--hidden 512]
[--dists singletons top_k50 heavy] [--full-rows 2048] [--repeats 5] [--device cpu|cuda]``

Every variant starts from fp32 hidden states ``[N, H]`` and an LM-head weight ``[V, H]`` and runs
forward + backward (gradients for hidden and weight) of ``Σ_n u_n · logp_n``, at the default
chunk size:

- ``ragged``: :func:`rollfeed.models.fused_support_logprobs` with the support as
  :class:`rollfeed.collate.RaggedRows` (work and memory follow the kept ids);
- ``padded``: the same call given the padded ``[N, W]`` form (``W`` the widest row), which the
  scorer takes as rows of ``W`` slots: every slot is planned, sorted and masked, as before
  supports were ragged (only the kept pairs are projected in both);
- ``full``: ``log_softmax(hidden @ weight.T).gather(labels)``, the full-vocabulary trainer, at
  ``--full-rows`` rows only (its ``[N, V]`` logits at 16,384 rows would not fit).

Three kept-set distributions, 16,384 rows (the label first in each row, distinct ids):

- ``singletons``: mean ~1.7, 60% singletons (a low temperature or min-p);
- ``top_k50``: top-k 50, mean ~3.7 (45% singletons), one row of the full 50;
- ``heavy``: top-p 0.97-like, mean ~8, median 2, p99 ~75, 48% singletons, a few rows of
  1,024 ids.

Each variant runs in its own subprocess, so one variant's allocations cannot hide in another's peak.
Peak memory is the process's own resident-set high-water mark (``VmHWM``, reset once the inputs
exist: :mod:`rollfeed.bench._process`) at the end, minus the
resident set right after the inputs are allocated and a tiny warm-up run of the same variant
(``/proc/self/statm``), minus the two gradient buffers every variant must produce (the weight's
``V·H·4`` and the hidden states' ``N·H·4`` bytes): what remains is the scorer's own temporaries.
PyTorch's CPU allocator does not cache, so freed temporaries are returned and the high-water mark is
what the variant really needed at once. Time is the median of ``--repeats`` runs (wall clock, and
the process's CPU time, which swings less with the machine's load), measured in one more process
that runs the two variants of a line in turn on the same inputs (after one run of each), so the load
swings alike for both. The error is the largest absolute difference of the logprobs from a float64
evaluation over 256 rows (the widest among them), computed after the measurements. With ``--device
cuda`` each run is timed between two ``torch.cuda.synchronize()`` calls and the peak is
``torch.cuda.max_memory_allocated`` above what was allocated after the inputs and the warm-up, less
the same two gradients.

Contention: the heavy-tailed distribution's ragged and padded runs (and ragged against the full
vocabulary at ``--full-rows``) timed with every core free and with one core held busy by another
process (``while 1: pass``), rounds interleaved in one process; the line prints each busy/free
ratio. Losing one of 2 cores should cost at most 2x: the fused scorer's short chunk ops run on one
thread (:mod:`rollfeed.models.threads`), since an intra-op thread on the busy core stretched each
of hundreds of sub-millisecond parallel regions to a time slice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from rollfeed.bench._process import busy_core, peak_bytes, reset_peak, resident_bytes, run_variant
from rollfeed.collate import RaggedRows
from rollfeed.models import fused_support_logprobs

VARIANTS = ("ragged", "padded", "full")
DISTS = ("singletons", "top_k50", "heavy")
CHECKED_ROWS = 256
# glibc's mmap threshold held at 64 KiB in the memory children (it grows with each freed large
# block otherwise): every freed temporary of that size goes back to the system at once, so the
# resident high-water mark counts only what was live together. Without it one variant's figure swung
# between 4 and 29 MiB from run to run.
_FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _sizes(dist: str, rows: int, g: torch.Generator) -> torch.Tensor:
    """``[rows]`` kept-set sizes of one distribution (see the module doc)."""
    u = torch.rand(rows, generator=g)
    # A geometric count of failures with success probability p, by its inverse CDF.
    v = torch.rand(rows, generator=g).clamp(min=1e-12)
    if dist == "singletons":
        # 60% singletons; the rest 2 + a geometric count of mean 0.75 -> overall mean ~1.7.
        rest = 2 + (v.log() / torch.log(torch.tensor(1 - 0.57))).floor().long()
        return torch.where(u < 0.6, 1, rest).clamp(max=64)
    if dist == "top_k50":
        rest = 2 + (v.log() / torch.log(torch.tensor(1 - 0.2))).floor().long()
        sizes = torch.where(u < 0.45, 1, rest).clamp(max=50)
        sizes[0] = 50
        return sizes
    # 47% singletons; the rest 1 + lognormal (mu 1.8, sigma 1.2): mean ~8, median 2, p99 ~75.
    z = torch.randn(rows, generator=g)
    rest = (1 + torch.exp(1.8 + 1.2 * z)).round().long()
    sizes = torch.where(u < 0.47, 1, rest).clamp(1, 1024)
    sizes[:: max(1, rows // 4)] = 1024  # a few rows in the thousands' range
    return sizes


def _inputs(dist: str, rows: int, vocab: int, hidden: int) -> dict:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g).mul_(2.0 / hidden**0.5)  # in place: no transient
    labels = torch.randint(0, vocab, (rows,), generator=g)
    sizes = _sizes(dist, rows, g)
    # Distinct ids per row, the label first: the label plus increasing random offsets (mod V).
    total = int(sizes.sum())
    offsets = torch.zeros(rows + 1, dtype=torch.int64)
    torch.cumsum(sizes, 0, out=offsets[1:])
    row_of = torch.repeat_interleave(torch.arange(rows), sizes, output_size=total)
    slot = torch.arange(total) - offsets[row_of]
    steps = torch.randint(1, max(2, vocab // 2048), (total,), generator=g)
    steps[slot == 0] = 0
    cum = steps.cumsum(0)
    within = cum - cum[offsets[row_of]]  # the offsets restart at each row's first slot
    values = (labels[row_of] + within) % vocab
    support = RaggedRows(offsets, values)
    return {"hidden": h, "weight": w, "labels": labels, "support": support}


def _run(variant: str, x: dict, up: torch.Tensor) -> torch.Tensor:
    h, w = x["hidden"], x["weight"]
    if variant == "full":
        logp = torch.log_softmax(h @ w.T, -1).gather(1, x["labels"][:, None]).squeeze(1)
    else:
        support = x["support"] if variant == "ragged" else x["padded"]
        logp = fused_support_logprobs(h, w, x["labels"], support).logprobs
    (logp * up).sum().backward()
    return logp.detach()


def _reference(variant: str, x: dict, rows: torch.Tensor) -> torch.Tensor:
    """Float64 logprobs of ``rows [k]``: over the whole vocabulary in one product, or one row at a
    time over its ids."""
    h, w, support = x["hidden"].double(), x["weight"].double(), x["support"]
    labels = x["labels"][rows]
    label_logits = (h[rows] * w[labels]).sum(-1)
    if variant == "full":
        return label_logits - (h[rows] @ w.T).logsumexp(-1)
    lse = []
    for n in rows.tolist():
        ids = support.values[support.offsets[n] : support.offsets[n + 1]].long()
        lse.append((w[ids] @ h[n]).logsumexp(0))
    return label_logits - torch.stack(lse)


def _on(device: torch.device, x: dict, variants: list[str]) -> dict:
    """The inputs moved to ``device`` (with the padded form, made there, when ``padded`` runs),
    hidden and weight as leaves that require grad."""
    out = {k: v.to(device) for k, v in x.items()}
    if "padded" in variants:
        out["padded"] = out["support"].padded(fill=-1)
    out["hidden"].requires_grad_()
    out["weight"].requires_grad_()
    return out


def _timed(
    x: dict, variant: str, up: torch.Tensor, device: torch.device
) -> tuple[tuple, torch.Tensor]:
    """``((wall seconds, process CPU seconds), logp)`` of one run."""
    x["hidden"].grad = x["weight"].grad = None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start, cpu = time.perf_counter(), time.process_time()
    logp = _run(variant, x, up)
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start, time.process_time() - cpu), logp


def _contention(x: dict, variants: list[str], up: torch.Tensor, device, repeats: int) -> dict:
    """Median wall seconds of each variant with every core free and with one held busy by
    another process (:func:`~rollfeed.bench._process.busy_core`), the two rounds interleaved
    ``repeats`` times."""
    for v in variants:
        _timed(x, v, up, device)
    times: dict[str, list[float]] = {f"{v} {c}": [] for v in variants for c in ("idle", "busy")}
    for _ in range(repeats):
        for v in variants:
            times[f"{v} idle"].append(_timed(x, v, up, device)[0][0])
        with busy_core():
            for v in variants:
                times[f"{v} busy"].append(_timed(x, v, up, device)[0][0])
    return {k: statistics.median(t) for k, t in times.items()}


def _child(args: argparse.Namespace) -> None:
    """``--child time``: the variants' runs interleaved on shared inputs (the machine's load
    swings alike for all), medians; ``--child VARIANT``: one run's extra peak memory and error."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    variants = args.variants if args.child in ("time", "contention") else [args.child]
    x = _on(device, _inputs(args.dist, args.rows, args.vocab, args.hidden), variants)
    up = torch.randn(args.rows).to(device)
    if args.child == "contention":
        print(json.dumps(_contention(x, variants, up, device, args.repeats)))
        return
    if args.child == "time":
        times: dict[str, list[tuple]] = {v: [] for v in variants}
        for v in variants:
            _timed(x, v, up, device)  # first-run costs out of the medians
        for _ in range(args.repeats):
            for v in variants:
                times[v].append(_timed(x, v, up, device)[0])
        medians = {
            v: {
                "seconds": statistics.median(w for w, _ in t),
                "cpu": statistics.median(c for _, c in t),
            }
            for v, t in times.items()
        }
        print(json.dumps(medians))
        return
    # A tiny run first, so one-time costs (kernel selection, thread pools, the CUDA context) are
    # not in the peak.
    _run(args.child, _on(device, _inputs(args.dist, 16, 4096, args.hidden), variants), up[:16])
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = resident_bytes()
        reset_peak()
    _, logp = _timed(x, args.child, up, device)
    peak = torch.cuda.max_memory_allocated(device) if cuda else peak_bytes()
    extra = peak - base - (x["weight"].numel() + x["hidden"].numel()) * 4
    lengths = x["support"].lengths().cpu()
    rows = torch.cat([lengths.argsort(descending=True)[:8], torch.arange(CHECKED_ROWS - 8)])
    cpu = {
        k: v.detach().cpu() if isinstance(v, torch.Tensor) else v.to("cpu") for k, v in x.items()
    }
    err = (logp.cpu()[rows].double() - _reference(args.child, cpu, rows)).abs().max().item()
    print(json.dumps({"extra_bytes": extra, "err": err}))


def _stats(dist: str, rows: int) -> str:
    sizes = _sizes(dist, rows, torch.Generator().manual_seed(0)).double()
    q = torch.quantile(sizes, torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
    single = float((sizes == 1).double().mean())
    return (
        f"mean {float(sizes.mean()):4.1f} median {q[0]:3.0f} p99 {q[1]:4.0f} "
        f"max {int(sizes.max()):4d} singletons {single:4.0%}"
    )


def _measure(child: str, dist: str, rows: int, args: argparse.Namespace, *variants: str) -> dict:
    argv = ["--child", child, "--dists", dist, "--rows", str(rows), "--vocab", str(args.vocab)]
    argv += ["--hidden", str(args.hidden), "--repeats", str(args.repeats), "--device", args.device]
    # the threshold is pinned for the memory children only: pinned, every temporary of 64 KiB
    # or more is a fresh mapping, faulted in page by page, which is not what a trainer's
    # allocator does (it took the heavy-tailed ragged run from 0.3 s to 0.77 s)
    env = None if child in ("time", "contention") else _FIXED_MMAP
    return run_variant("rollfeed.bench.scoring", [*argv, "--variants", *variants], env=env)


def _case(dist: str, rows: int, args: argparse.Namespace, a: str, b: str) -> tuple[dict, dict]:
    """``(a, b)`` measures: median seconds (interleaved, one process), extra memory and error
    (a process each)."""
    times = _measure("time", dist, rows, args, a, b)
    out = []
    for v in (a, b):
        m = _measure(v, dist, rows, args, v)
        out.append({**times[v], **m})
    return out[0], out[1]


def _line(name: str, m: dict[str, float]) -> str:
    return (
        f"{name} {m['seconds'] * 1e3:8.1f} ms (CPU {m['cpu'] * 1e3:8.1f} ms) "
        f"{m['extra_bytes'] / 2**20:7.1f} MiB err {m['err']:.1e}"
    )


def _ratios(a: dict[str, float], b: dict[str, float]) -> str:
    """``a`` against ``b``: time ratios (wall, CPU) and how much less extra memory."""
    return (
        f"time {a['seconds'] / b['seconds']:.3f} (CPU {a['cpu'] / b['cpu']:.3f}), "
        f"{b['extra_bytes'] / max(a['extra_bytes'], 1):.1f}x less extra memory"
    )


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m rollfeed.bench scoring")
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--dists", nargs="+", choices=DISTS, default=list(DISTS))
    p.add_argument("--full-rows", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--child", choices=("time", "contention", *VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.dist = args.dists[0]
        _child(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "bench scoring --device cuda: torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda}); run it on a machine with "
            "a CUDA GPU, or drop --device for the CPU benchmark"
        )
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"scoring: V={args.vocab} H={args.hidden} fp32 on {where}, fused forward+backward at the "
        f"default chunk, median of {args.repeats}; memory = peak above inputs and the weight and "
        "hidden grads"
    )
    for dist in args.dists:
        ragged, padded = _case(dist, args.rows, args, "ragged", "padded")
        print(f"{dist:>10} N={args.rows}: {_stats(dist, args.rows)}")
        print(f"  {_line('ragged', ragged)} | {_line('padded', padded)}")
        print(f"  ragged/padded {_ratios(ragged, padded)}")
    dist = args.dists[-1]
    ragged, full = _case(dist, args.full_rows, args, "ragged", "full")
    print(f"{dist:>10} N={args.full_rows}: {_stats(dist, args.full_rows)}")
    print(f"  {_line('ragged', ragged)} | {_line('full vocabulary', full)}")
    print(f"  ragged/full {_ratios(ragged, full)}")
    print(
        f"contention ({dist}): the same runs with one of {os.cpu_count()} cores held busy by "
        "another process, interleaved with free ones; goal: busy/free no worse than the share "
        "of the cores lost"
    )
    for rows, pair in ((args.rows, ("ragged", "padded")), (args.full_rows, ("ragged", "full"))):
        got = _measure("contention", dist, rows, args, *pair)
        print(f"  N={rows}: " + " | ".join(_contended(v, got) for v in pair))


def _contended(variant: str, got: dict[str, float]) -> str:
    free, busy = got[f"{variant} idle"], got[f"{variant} busy"]
    return f"{variant} {free * 1e3:.1f} ms free, {busy * 1e3:.1f} ms busy ({busy / free:.2f}x)"


if __name__ == "__main__":
    main(sys.argv[1:])
