"""Batch planning benchmark: ``python -m rollfeed.bench batches [--seed N]``.

Lognormal sample lengths (mean 2k tokens), seq_len 16k, dp 8; each sample carries four segment
records (routing in two files, a mask region split in two), as by-handle rollouts do. Prints:

- planning time of ``prepare_batch`` for 4,096 samples against 512 (goal: <= 10x for 8x samples);
- DP balance, max/mean rank cost (goal <= 1.05);
- causal attention work across CP ranks (max/mean per micro batch), contiguous against zigzag.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from rollfeed.collate import PlanConfig, Sample, prepare_batch
from rollfeed.collate.cp import attention_work, rank_ranges
from rollfeed.payload import PayloadSegment, RaggedLayout

SEQ_LEN, DP = 16384, 8


def _samples(n: int, rng: np.random.Generator) -> list[Sample]:
    sigma = 1.0
    lengths = np.maximum(rng.lognormal(np.log(2048) - sigma**2 / 2, sigma, n).astype(int), 1)
    out = []
    for i, T in enumerate(lengths.tolist()):
        P = T // 3
        q = (T - 1) // 2
        lay = RaggedLayout(rows=T - P, values=2 * (T - P), count_bytes=1, block_rows=128)
        route = dict(field="routed_experts", offset=64, dtype="uint8", shape=(4, 2))
        m = P + (T - P) // 2
        mask = dict(field="sampling_mask", file=f"a{i}.rfp", offset=4096, dtype="int32", ragged=lay)
        segs = [
            PayloadSegment(file=f"a{i}.rfp", pos=0, rows=q, **route),
            PayloadSegment(file=f"b{i}.rfp", pos=q, rows=T - 1 - q, **route),
            PayloadSegment(pos=P, rows=m - P, **mask),
            PayloadSegment(pos=m, rows=T - m, first=m - P, **mask),
        ]  # fmt: skip
        out.append(
            Sample(
                np.zeros(T, np.int64),
                loss_mask=np.arange(T) >= P,
                advantages=np.zeros(T, np.float32),
                inference_logprobs=np.zeros(T, np.float32),
                payload=segs,
            )
        )
    return out


def _time(samples: list[Sample], repeats: int, **kw) -> tuple[float, dict]:
    best = float("inf")
    for _ in range(repeats):
        gc.collect()  # a full collection owed by building the samples is not planning time
        t = time.perf_counter()
        plan = prepare_batch(samples, PlanConfig(seq_len=SEQ_LEN, **kw), dp_size=DP)
        best = min(best, time.perf_counter() - t)
    return best, plan


def _cp_imbalance(plan) -> float:
    """Work-weighted mean over micro batches of max/mean attention work across CP ranks."""
    num = den = 0.0
    for mb in (mb for r in plan for mb in r if not mb.is_dummy):
        cp_size, layout = mb.config.cp_size, mb.config.cp_layout
        work = [attention_work(mb.cu_seqlens, rank_ranges(mb.cu_seqlens, r, cp_size, layout))
                for r in range(cp_size)]  # fmt: skip
        num += max(work) * cp_size
        den += sum(work)
    return num / den


def main(argv: list[str]) -> None:
    args = argparse.ArgumentParser(prog="python -m rollfeed.bench batches")
    args.add_argument("--seed", type=int, default=0)
    args.add_argument("--repeats", type=int, default=3)
    opts = args.parse_args(argv)
    rng = np.random.default_rng(opts.seed)
    small, large = _samples(512, rng), _samples(4096, rng)
    t_small, p_small = _time(small, opts.repeats)
    t_large, p_large = _time(large, opts.repeats)
    print(f"batches: seq_len={SEQ_LEN} dp={DP}, lognormal lengths mean ~2k (seed {opts.seed})")
    for n, t, p in ((512, t_small, p_small), (4096, t_large, p_large)):
        m = p.metrics
        print(
            f"  {n:5d} samples: plan {t * 1e3:8.1f} ms  micro_steps={m['micro_steps']:3d}  "
            f"truncated={m['truncated']}  padding={m['padding_fraction']:.3f}  "
            f"rank cost max/mean={m['rank_cost_max_over_mean']:.4f}  (goal <= 1.05)"
        )
    print(f"  time ratio 4096/512 = {t_large / t_small:.2f}x for 8x samples (goal <= 10x)")
    for cp in (2, 4, 8):
        _, c_plan = _time(large, 1, cp_size=cp, cp_layout="contiguous")
        contiguous = _cp_imbalance(c_plan)
        _, zz_plan = _time(large, 1, cp_size=cp, cp_layout="zigzag")
        zigzag = _cp_imbalance(zz_plan)
        print(
            f"  cp={cp}: attention work max/mean across CP ranks: contiguous {contiguous:.3f}, "
            f"zigzag {zigzag:.3f}  (zigzag padding {zz_plan.metrics['padding_fraction']:.3f})"
        )
