"""Packed attention: per-sample causal SDPA vs one SDPA call with a dense ``[S, S]`` block mask.

``python -m rollfeed.bench attention [--tokens 16384] [--samples 8] [--heads 4] [--kv-heads 2]
[--head-dim 16] [--repeats 2]``

One packed row of ``--tokens`` fp32 tokens in ``--samples`` samples of equal length, tiny heads, so
attention's own costs show rather than the projections':

- ``dense``: the layout's ``[S, S]`` bool mask (:attr:`PackedLayout.allowed`) handed to
  ``scaled_dot_product_attention`` as ``attn_mask``, the way packed attention used to run;
- ``packed``: :func:`rollfeed.models.packing_attention.packed_attention_forward`.

Each variant runs in its own subprocess. ``layout`` is the time to build the layout (once per model
forward; for ``dense`` it includes the mask), ``attention`` the best of ``--repeats`` forward +
backward runs of one attention call (once per layer). Peak memory is the resident-set high-water
mark minus the resident set after the inputs exist and a tiny warm-up run (one-time library costs
are not the variant's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from rollfeed.bench._process import peak_bytes, resident_bytes, run_variant
from rollfeed.models.packing_attention import packed_attention_forward, packed_layout

VARIANTS = ("dense", "packed")


def _layout(variant: str, tokens: int, samples: int):
    layout = packed_layout(torch.arange(tokens) % (tokens // samples))
    return layout, (layout.allowed if variant == "dense" else None)


def _attend(variant: str, layout, mask, q, k, v) -> None:
    if variant == "dense":
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    else:
        out, _ = packed_attention_forward(torch.nn.Module().eval(), q, k, v, None, packing=layout)
    out.sum().backward()


def _inputs(args: argparse.Namespace, tokens: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    heads = (args.heads, args.kv_heads, args.kv_heads)
    return [torch.randn(1, h, tokens, args.head_dim, generator=g).requires_grad_() for h in heads]


def _child(args: argparse.Namespace) -> None:
    tiny = _inputs(args, 64)
    _attend(args.child, *_layout(args.child, 64, 4), *tiny)
    del tiny
    q, k, v = _inputs(args, args.tokens)
    base = resident_bytes()
    start = time.perf_counter()
    layout, mask = _layout(args.child, args.tokens, args.samples)
    layout_s = time.perf_counter() - start
    best = float("inf")
    for _ in range(args.repeats):
        q.grad = k.grad = v.grad = None
        start = time.perf_counter()
        _attend(args.child, layout, mask, q, k, v)
        best = min(best, time.perf_counter() - start)
    peak = peak_bytes() - base
    print(json.dumps({"layout": layout_s, "attention": best, "peak": peak}))


def _measure(variant: str, args: argparse.Namespace) -> dict[str, float]:
    argv = ["--child", variant]
    for flag in ("tokens", "samples", "heads", "kv_heads", "head_dim", "repeats"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return run_variant("rollfeed.bench.attention", argv)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m rollfeed.bench attention")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return
    print(
        f"attention: S={args.tokens} in {args.samples} samples, heads {args.heads}/"
        f"{args.kv_heads} kv, d={args.head_dim}, fp32, forward+backward, best of {args.repeats}"
    )
    dense, packed = (_measure(v, args) for v in VARIANTS)
    mib = 2**20
    for name, r in (("dense", dense), ("packed", packed)):
        print(
            f"{name:>6}  layout {r['layout'] * 1e3:8.1f} ms  attention {r['attention'] * 1e3:8.1f}"
            f" ms  peak {r['peak'] / mib:8.1f} MiB"
        )
    print(
        f"packed is {dense['attention'] / packed['attention']:.1f}x faster per attention call, "
        f"{dense['layout'] / packed['layout']:.1f}x faster to lay out, "
        f"{dense['peak'] / max(packed['peak'], 1):.1f}x less peak memory"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
