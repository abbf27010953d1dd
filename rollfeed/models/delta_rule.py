"""Gated DeltaNet's two row-wise kernels over a packed row: the causal conv1d and the gated delta
rule, each restarting at every segment (sample) boundary.

Both carry state along the row, so packing is exact only when a sample sees none of the previous
one: the conv's left context is zero at a sample's first token, and the delta rule's state is
reset there. Inputs are one canonical row (the samples in order, ``segments`` their bounds).

- :func:`causal_conv1d_packed` ``x [S, C]`` -> ``silu(conv(x)) [S, C]``, depthwise, kernel ``K``:
  ``out[t, c] = Σ_{s < K, s <= t - start(t)} w[c, K - 1 - s] · x[t - s, c]``;
- :func:`gated_delta_rule_packed` ``q, k [S, H, dk]``, ``v [S, H, dv]``, ``g, beta [S, H]`` ->
  ``[S, H, dv]``: with ``q, k`` L2-normalised and ``q`` scaled by ``dk^-1/2``, per head a state
  ``M [dk, dv]`` (zero at each sample's first token) runs
  ``M_t = e^{g_t} (I - β_t k_t k_tᵀ) M_{t-1} + β_t k_t v_tᵀ`` and ``o_t = M_tᵀ q_t``
  (Yang et al., "Gated Delta Networks", arXiv:2412.06464).

The torch reference computes in the inputs' dtype (float32 at least), exact in float64: the conv
as ``K`` masked shifted products, the delta rule in chunks of :data:`CHUNK` tokens that never
span two samples (each sample's chunks start at its first token, the last one padded with zero
keys, values and betas), the chunk's updates folded by one unit-lower-triangular solve (the
WY/UT form of DeltaNet, Yang et al., arXiv:2406.06484) and a scan over the row's chunks that
resets the state at each sample's first chunk. On CUDA (float32 or less) the kernels of
``causal-conv1d`` (``causal_conv1d_fn(..., seq_idx=)``) and ``flash-linear-attention``
(``chunk_gated_delta_rule(..., cu_seqlens=)``) are used when installed (:func:`kernel_names`).

Example, segments (0, 3, 5), ``K = 4``: token 3 (the second sample's first) convolves only
itself; with chunk 2 the delta rule's chunks hold tokens (0, 1), (2, pad), (3, 4), and the state
is reset before chunks 0 and 2.

A row holding prefix trees forks both at every branch point: its segments are the tree's spans,
the conv reads each token's ``K - 1`` predecessors along its path (``history``: a branch's first
tokens read the last inputs of the prefix above it), and a span's delta-rule state starts from
its parent span's final state (``parents``) instead of zero. Trees run the torch reference on
every device. Example, a prompt (0, 4) with branches (4, 6) and (6, 9), ``K = 4``: token 6 (the
second branch's first) convolves tokens 1, 2, 3 and itself; both branches start from the state
after token 3.
"""

from __future__ import annotations

import importlib.util
import itertools
import math

import torch
import torch.nn.functional as F

from rollfeed.models.row_segments import Segments

CHUNK = 64  # flash-linear-attention's chunk; any size is exact


def _fast(x: torch.Tensor, package: str) -> bool:
    return x.is_cuda and x.dtype != torch.float64 and importlib.util.find_spec(package) is not None


def kernel_names(device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Which implementation each kernel runs for inputs on ``device`` of ``dtype``.

    Example: on CPU ``{"conv1d": "torch", "delta_rule": "torch"}``; on CUDA in bf16 with both
    packages installed ``{"conv1d": "causal_conv1d", "delta_rule": "fla"}``.
    """
    probe = torch.empty(0, device=device, dtype=dtype)
    return {
        "conv1d": "causal_conv1d" if _fast(probe, "causal_conv1d") else "torch",
        "delta_rule": "fla" if _fast(probe, "fla") else "torch",
    }


def _segment_ids(segments: Segments, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(segment [n], offset [n])``: each token's segment and its index within it."""
    cu = segments.cu_seqlens.long()
    ids = torch.arange(cu.numel() - 1, device=cu.device)
    segment = torch.repeat_interleave(ids, cu.diff(), output_size=n)
    return segment, torch.arange(n, device=cu.device) - cu[segment]


def causal_conv1d_packed(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    segments: Segments,
    *,
    history: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d and SiLU of ``x [S, C]`` with ``weight [C, K]`` (``bias [C]``),
    zero left context at each segment's first token -> ``[S, C]`` in ``x``'s dtype (computed in
    the weight's, as ``nn.Conv1d`` does). ``history [S, >= K - 1]``: for a tree row, the row of
    each token's ``s + 1``-th predecessor along its path (``-1``: none) in column ``s``."""
    rows, width = x.shape
    if history is not None:
        xw = x.to(weight.dtype)
        taps = weight.shape[1]
        out = xw * weight[:, taps - 1]
        for shift in range(1, taps):
            back = history[:, shift - 1]
            earlier = torch.where((back >= 0)[:, None], xw[back.clamp(min=0)], 0)
            out = out + earlier * weight[:, taps - 1 - shift]
        if bias is not None:
            out = out + bias
        return F.silu(out).to(x.dtype)
    if _fast(x, "causal_conv1d"):
        from causal_conv1d import causal_conv1d_fn

        segment, _ = _segment_ids(segments, rows)
        channels_last = x.to(weight.dtype).T[None]  # [1, C, S] with unit channel stride
        out = causal_conv1d_fn(
            channels_last, weight, bias, seq_idx=segment.to(torch.int32)[None], activation="silu"
        )
        return out[0].T.to(x.dtype)
    xw = x.to(weight.dtype)
    _, offset = _segment_ids(segments, rows)
    taps = weight.shape[1]
    out = xw * weight[:, taps - 1]
    for shift in range(1, taps):
        earlier = torch.cat([xw.new_zeros(min(shift, rows), width), xw[: max(rows - shift, 0)]])
        out = (
            out + torch.where((offset >= shift)[:, None], earlier, 0) * weight[:, taps - 1 - shift]
        )
    if bias is not None:
        out = out + bias
    return F.silu(out).to(x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # flash-linear-attention's normalisation of q and k (eps inside the root).
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_rule_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    segments: Segments,
    *,
    chunk_size: int = CHUNK,
    parents: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The gated delta rule over a packed row (see the module doc), state reset per segment.

    ``q, k [S, H, dk]`` (one per value head), ``v [S, H, dv]``, ``g [S, H]`` log decays
    (``<= 0``), ``beta [S, H]`` -> ``[S, H, dv]`` in ``q``'s dtype. ``q`` and ``k`` are
    L2-normalised here. ``parents``: per segment, the earlier segment whose final state it
    starts from (``-1``: zero), for a tree row.
    """
    if parents is None and _fast(q, "fla"):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        out, _ = chunk_gated_delta_rule(
            q=q[None],
            k=k[None],
            v=v[None],
            g=g[None].float(),
            beta=beta[None],
            scale=q.shape[-1] ** -0.5,
            cu_seqlens=segments.cu_seqlens.long(),
            use_qk_l2norm_in_kernel=True,
        )
        return out[0]
    return _chunked(q, k, v, g, beta, segments, chunk_size, parents).to(q.dtype)


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    segments: Segments,
    size: int,
    parents: tuple[int, ...] | None = None,
) -> torch.Tensor:
    rows, heads, dk = q.shape
    dt = torch.promote_types(q.dtype, torch.float32)
    q = _l2norm(q.to(dt)) * dk**-0.5
    k, v, g, beta = _l2norm(k.to(dt)), v.to(dt), g.to(dt), beta.to(dt)
    # Host: chunks per segment and the chunks that open one (the state resets there).
    per = [math.ceil((b - a) / size) for a, b in itertools.pairwise(segments.bounds)]
    total = sum(per)
    firsts = [0, *itertools.accumulate(per[:-1])]
    opens = dict(zip(firsts, range(len(per)), strict=True))  # chunk -> the segment it opens
    lasts = {f + n - 1: s for s, (f, n) in enumerate(zip(firsts, per, strict=True))}
    finals: dict[int, torch.Tensor] = {}
    # Device: each chunk slot's token (padding slots masked), without a host sync.
    cu = segments.cu_seqlens.long()
    lengths = cu.diff()
    per_dev = (lengths + size - 1) // size
    owner = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=cu.device), per_dev, output_size=total
    )
    first = per_dev.cumsum(0) - per_dev
    within = (torch.arange(total, device=cu.device) - first[owner]) * size
    col = torch.arange(size, device=cu.device)
    source = (cu[owner, None] + within[:, None] + col).clamp(max=rows - 1)  # [N, C]
    real = col < (lengths[owner] - within)[:, None]

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [S, H, ...] -> [H, N, C, ...]
        picked = torch.where(real.view(*real.shape, *(1,) * (x.dim() - 1)), x[source], 0)
        return picked.movedim(2, 0)

    qc, kc, vc, gc, bc = (chunks(x) for x in (q, k, v, g, beta))
    gamma = gc.cumsum(-1)  # [H, N, C] log decay from the chunk's start
    later = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(later, float("-inf")).exp()
    # u = T⁻¹(βv) - T⁻¹(β e^γ k) M with T = I + strict_lower(β_i e^{γ_i-γ_j} k_i·k_j).
    lower = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
    solve = lambda rhs: torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)  # noqa: E731
    u_free = solve(bc[..., None] * vc)
    w = solve((bc * gamma.exp())[..., None] * kc)
    inner = (qc @ kc.transpose(-1, -2)) * decay  # [H, N, C, C], diagonal included
    q_read = qc * gamma.exp()[..., None]
    k_write = kc * (gamma[..., -1:] - gamma).exp()[..., None]
    carry = gamma[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    state = q.new_zeros(heads, dk, v.shape[-1])
    outs = []
    # One unbind per tensor, not a slice per chunk: a slice's backward writes a zero tensor of the
    # whole [H, N, ...] shape, which would make the backward quadratic in the row's chunks.
    per_chunk = (x.unbind(1) for x in (u_free, w, q_read, inner, k_write, carry))
    for n, (u_n, w_n, q_n, inner_n, k_n, carry_n) in enumerate(zip(*per_chunk, strict=True)):
        if n in opens:
            parent = -1 if parents is None else parents[opens[n]]
            state = q.new_zeros(heads, dk, v.shape[-1]) if parent < 0 else finals[parent]
        u = u_n - w_n @ state
        outs.append(q_n @ state + inner_n @ u)
        state = state * carry_n + k_n.transpose(-1, -2) @ u
        if parents is not None and n in lasts:
            finals[lasts[n]] = state
    out = torch.stack(outs, 1).movedim(0, 2).reshape(total * size, heads, -1)  # [N·C, H, dv]
    segment, offset = _segment_ids(segments, rows)
    return out[first[segment] * size + offset]
