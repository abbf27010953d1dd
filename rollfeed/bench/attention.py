"""Packed attention, and a packed hybrid stack against a per-sample loop.

``python -m rollfeed.bench attention [--tokens 16384] [--samples 8] [--heads 4] [--kv-heads 2]
[--head-dim 16] [--hybrid-tokens 2048] [--hybrid-samples 16] [--repeats 2] [--device cpu|cuda]
[--parts attention hybrid]``

**Attention.** One packed row of ``--tokens`` tokens in ``--samples`` samples of equal length,
tiny heads, so attention's own costs show rather than the projections':

- ``dense``: the layout's ``[S, S]`` bool mask (:attr:`PackedLayout.allowed`) handed to
  ``scaled_dot_product_attention`` as ``attn_mask``, the way packed attention used to run;
- ``packed``: :func:`rollfeed.models.packing_attention.packed_attention_forward` (on CUDA in bf16
  one varlen kernel call, :mod:`rollfeed.models.segment_attention`).

``layout`` is the time to build the layout (once per model forward; for ``dense`` it includes the
mask), ``attention`` the best of ``--repeats`` forward + backward runs of one attention call.

**Hybrid stack.** A Qwen3-Next-shaped decoder stack (random weights, hidden 256, three Gated
DeltaNet layers and one gated full-attention layer, dense MLPs) over ``--hybrid-tokens`` tokens in
``--hybrid-samples`` samples of uneven lengths (a fixed draw), forward + backward of the stack's
output:

- ``hybrid_packed``: the whole row at once through rollfeed's layers (one packed layout);
- ``hybrid_loop``: each sample alone through the same layers, forward + backward per sample
  (gradients accumulated), the way a trainer without packing scores a micro batch.

Each variant runs in its own subprocess. On the CPU peak memory is the resident-set high-water
mark minus the resident set after the inputs exist and a tiny warm-up run (one-time library costs
are not the variant's); with ``--device cuda`` (bf16) it is ``torch.cuda.max_memory_allocated``
above what was allocated then, and each run is timed between ``torch.cuda.synchronize()`` calls.
The hybrid lines also give the process's CPU time of the best run, which other processes on a
loaded machine disturb less than the wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from rollfeed.bench._process import peak_bytes, reset_peak, resident_bytes, run_variant
from rollfeed.models.packing_attention import (
    packed_attention_forward,
    packed_layout,
    register_packed_attention,
)
from rollfeed.models.packing_modules import install_packed_forwards

MIB = 2**20
ATTENTION = ("dense", "packed")
HYBRID = ("hybrid_packed", "hybrid_loop")


def _layout(variant: str, tokens: int, samples: int, device: torch.device):
    layout = packed_layout(torch.arange(tokens, device=device) % (tokens // samples))
    return layout, (layout.allowed if variant == "dense" else None)


def _attend(variant: str, layout, mask, q, k, v) -> None:
    if variant == "dense":
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    else:
        out, _ = packed_attention_forward(torch.nn.Module().eval(), q, k, v, None, packing=layout)
    out.sum().backward()


def _qkv(args: argparse.Namespace, tokens: int, device: torch.device, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    heads = (args.heads, args.kv_heads, args.kv_heads)
    return [
        torch.randn(1, h, tokens, args.head_dim, generator=g).to(device, dtype).requires_grad_()
        for h in heads
    ]


def _stack(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        mlp_only_layers=[0, 1, 2, 3],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        max_position_embeddings=1 << 16,
    )
    model = Qwen3NextForCausalLM(config).model.to(device, dtype)
    model.set_attn_implementation(register_packed_attention())
    install_packed_forwards(model)
    return model


def _lengths(tokens: int, samples: int) -> list[int]:
    """``samples`` uneven lengths summing to ``tokens`` (log-normal, a fixed draw)."""
    weights = torch.empty(samples).log_normal_(0.0, 0.8, generator=torch.Generator().manual_seed(1))
    lengths = (weights / weights.sum() * tokens).long().clamp(min=1)
    lengths[-1] += tokens - int(lengths.sum())
    return lengths.tolist()


def _hybrid(variant: str, model, ids: torch.Tensor, lengths: list[int]) -> None:
    pieces = [ids] if variant == "hybrid_packed" else list(ids.split(lengths))
    for part in pieces:
        run = lengths if variant == "hybrid_packed" else [part.numel()]
        pos = torch.cat([torch.arange(n, device=ids.device) for n in run])
        layout = packed_layout(pos)
        out = model(input_ids=part[None], position_ids=pos[None], packing=layout, use_cache=False)
        out.last_hidden_state.float().square().mean().backward()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _child(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.child in ATTENTION:
        _attend(args.child, *_layout(args.child, 64, 4, device), *_qkv(args, 64, device, dtype))
        inputs = _qkv(args, args.tokens, device, dtype)
        step = None
    else:
        model = _stack(device, dtype)
        lengths = _lengths(args.hybrid_tokens, args.hybrid_samples)
        ids = torch.randint(0, 1024, (args.hybrid_tokens,), generator=torch.Generator())
        ids = ids.to(device)
        _hybrid(args.child, model, ids[:96], [40, 56])
        step = (model, ids, lengths)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = resident_bytes()
        reset_peak()
    layout_s, best = 0.0, float("inf")
    if step is None:
        start = time.perf_counter()
        layout, mask = _layout(args.child, args.tokens, args.samples, device)
        _sync(device)
        layout_s = time.perf_counter() - start
    best_cpu = float("inf")
    for _ in range(args.repeats):
        _sync(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        if step is None:
            for x in inputs:
                x.grad = None
            _attend(args.child, layout, mask, *inputs)
        else:
            step[0].zero_grad(set_to_none=True)
            _hybrid(args.child, *step)
        _sync(device)
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_bytes()
    print(json.dumps({"layout": layout_s, "seconds": best, "cpu": best_cpu, "peak": peak - base}))


def _measure(variant: str, args: argparse.Namespace) -> dict[str, float]:
    argv = ["--child", variant]
    for flag in (
        "tokens",
        "samples",
        "heads",
        "kv_heads",
        "head_dim",
        "hybrid_tokens",
        "hybrid_samples",
        "repeats",
        "device",
    ):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return run_variant("rollfeed.bench.attention", argv)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m rollfeed.bench attention")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--hybrid-tokens", type=int, default=2048)
    p.add_argument("--hybrid-samples", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--parts", nargs="+", choices=("attention", "hybrid"), default=["attention", "hybrid"]
    )
    p.add_argument("--child", choices=ATTENTION + HYBRID, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "bench attention --device cuda: torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda}); run it on a machine with "
            "a CUDA GPU, or drop --device for the CPU benchmark"
        )
    where = "fp32" if args.device == "cpu" else f"bf16 on {torch.cuda.get_device_name()}"
    if "attention" in args.parts:
        _report_attention(args, where)
    if "hybrid" in args.parts:
        _report_hybrid(args, where)


def _report_attention(args: argparse.Namespace, where: str) -> None:
    print(
        f"attention: S={args.tokens} in {args.samples} samples, heads {args.heads}/"
        f"{args.kv_heads} kv, d={args.head_dim}, {where}, forward+backward, best of "
        f"{args.repeats}"
    )
    dense, packed = (_measure(v, args) for v in ATTENTION)
    for name, r in (("dense", dense), ("packed", packed)):
        print(
            f"{name:>6}  layout {r['layout'] * 1e3:8.1f} ms  attention {r['seconds'] * 1e3:8.1f}"
            f" ms  peak {r['peak'] / MIB:8.1f} MiB"
        )
    print(
        f"packed is {dense['seconds'] / packed['seconds']:.1f}x faster per attention call, "
        f"{dense['layout'] / packed['layout']:.1f}x faster to lay out, "
        f"{dense['peak'] / max(packed['peak'], 1):.1f}x less peak memory"
    )


def _report_hybrid(args: argparse.Namespace, where: str) -> None:
    lengths = _lengths(args.hybrid_tokens, args.hybrid_samples)
    print(
        f"hybrid stack: 3 Gated DeltaNet + 1 full attention layers, hidden 256, S="
        f"{args.hybrid_tokens} in {args.hybrid_samples} samples ({min(lengths)}..{max(lengths)} "
        f"tokens), {where}, forward+backward, best of {args.repeats}"
    )
    row, loop = (_measure(v, args) for v in HYBRID)
    for name, r in (("packed", row), ("loop", loop)):
        print(
            f"{name:>6}  {r['seconds'] * 1e3:8.1f} ms  (process CPU time {r['cpu'] * 1e3:8.1f} ms)"
            f"  peak {r['peak'] / MIB:8.1f} MiB"
        )
    print(
        f"packed is {loop['seconds'] / row['seconds']:.1f}x faster than the per-sample loop "
        f"({loop['cpu'] / row['cpu']:.1f}x in CPU time), at "
        f"{row['peak'] / max(loop['peak'], 1):.1f}x its peak memory (the loop holds one sample's "
        "activations at a time)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
