"""Tree attention: a packed row holding prefix trees, each shared prefix computed once, exact.

A tree row (:class:`~rollfeed.collate.TreeBatch`) is tiled by *spans*; a token attends to every
token of its span's ancestors and causally within its span, and its position is its depth along
its path. So a span of ``L`` tokens whose ancestors hold ``D`` tokens is the last ``L`` queries of
a causal sequence of ``D + L`` keys: the keys are gathered ``[ancestors; span]`` and the mask is
causal aligned to the lower right (query ``i`` sees key ``j`` when ``j <= D + i``), the alignment
a branch's queries need. A root span (``D = 0``: a prefix, a flat sample, padding) is plain
causal attention.

Kernels, each exact:

- **sdpa** (everywhere, the reference): a branch's queries in pieces of :data:`QUERY_CHUNK`, each
  over the keys up to its last query (a piece is the last queries of a causal sequence too), and
  pieces of equal ``(D, L)`` stacked into one batched SDPA call over their gathered keys with the
  lower-right causal mask (forward and backward run on CPU; flex attention has no CPU backward);
  root spans batched per length, ``is_causal``;
- **varlen** (CUDA, fp16/bf16, the conditions of
  :func:`~rollfeed.models.segment_attention.segment_kernel`): one call over the whole row with
  ``cu_seqlens_q`` the spans and ``cu_seqlens_k`` their gathered keys; flash kernels align a
  causal mask of ``L`` queries over ``D + L`` keys to the lower right, which is this mask.

A sliding window (query at depth ``p`` sees depths ``(p - window, p]``) and a chunked layer
(``p // chunk == d // chunk``, chunks counted from the sample's first token) become masks over the
same keys, so they keep their semantics along every path; sinks add a zero key column whose logit
is the head's sink, as in packed attention.

Example, a prompt of 4 shared by branches of 2 and 3 tokens (spans start 0, 4, 6)::

    span 0: sdpa(q[0:4], k[0:4], causal)
    spans 1, 2: keys [0, 1, 2, 3, 4, 5] and [0, 1, 2, 3, 6, 7, 8], lower-right causal masks
        [[1 1 1 1 1 0]        [[1 1 1 1 1 0 0]
         [1 1 1 1 1 1]]        [1 1 1 1 1 1 0]
                               [1 1 1 1 1 1 1]]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from rollfeed.models.errors import PackingError
from rollfeed.models.row_segments import Segments, make_segments
from rollfeed.models.segment_attention import segment_kernel, varlen_kernel

QUERY_CHUNK = 256  # measured on CPU: a 1024-token branch over 256 keys 1.4x faster than whole


@dataclass(frozen=True, kw_only=True, slots=True)
class TreeGroup:
    """Pieces of spans of one shape, attended in one call: ``depth`` keys before the piece's
    first query, ``length`` queries. ``starts``: their first row positions; ``keys [n, depth +
    length]``: each one's key rows (None for root spans: plain causal attention)."""

    depth: int
    length: int
    starts: tuple[int, ...]
    keys: torch.Tensor | None


@dataclass(frozen=True, kw_only=True, slots=True)
class TreeSpans:
    """The spans of a tree row in canonical order, as attention and the linear-attention kernels
    take them. ``segments``: the spans as :class:`Segments` (they tile the row);
    ``parents``: each span's parent (-1 for a root); ``depths``: tokens above each span;
    ``groups``: the batched attention calls; ``keys``/``cu_keys``: every span's key rows end to
    end and their bounds, for the varlen kernel."""

    segments: Segments
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    groups: tuple[TreeGroup, ...]
    keys: torch.Tensor
    cu_keys: torch.Tensor
    max_keys: int
    _history: dict[int, torch.Tensor] = field(default_factory=dict, hash=False, compare=False)

    @property
    def length(self) -> int:
        return self.segments.bounds[-1]

    def history(self, taps: int) -> torch.Tensor:
        """``[S, taps - 1]`` long: the row of the token ``s + 1`` steps earlier along each
        token's path (``-1`` before its sample's first token), for a causal conv of ``taps``."""
        if taps not in self._history:
            key_rows = self.keys.cpu().numpy()
            cu = self.cu_keys.cpu().numpy().astype(np.int64)
            bounds = self.segments.bounds
            out = np.full((self.length, max(taps - 1, 0)), -1, np.int64)
            for s in range(len(bounds) - 1):
                rows = key_rows[cu[s] : cu[s + 1]]  # the span's path, root first, itself last
                d = self.depths[s]
                for back in range(1, taps):
                    at = np.arange(d, d + bounds[s + 1] - bounds[s]) - back
                    ok = at >= 0
                    out[bounds[s] : bounds[s + 1], back - 1] = np.where(ok, rows[at.clip(0)], -1)
            self._history[taps] = torch.from_numpy(out).to(self.keys.device)
        return self._history[taps]


def tree_spans(
    starts: tuple[int, ...],
    depths: tuple[int, ...],
    lengths: tuple[int, ...],
    parents: tuple[int, ...],
    device: torch.device,
) -> TreeSpans:
    """:class:`TreeSpans` of a tree row (``TreeBatch`` tuples); the spans must tile the row in
    order and each continue its parent (:class:`PackingError` otherwise)."""
    n = len(starts)
    at = 0
    for s in range(n):
        parent = parents[s]
        top = 0 if parent < 0 else depths[parent] + lengths[parent]
        if starts[s] != at or lengths[s] < 1 or not parent < s or depths[s] != top:
            raise PackingError(
                f"tree span {s} (start {starts[s]}, depth {depths[s]}, length {lengths[s]}, "
                f"parent {parent}) does not tile the row after {at} or continue its parent; "
                "build the spans with to_tensor_micro_batch",
                tensor="tree",
            )
        at += lengths[s]
    rows: list[np.ndarray] = []
    for s in range(n):
        own = np.arange(starts[s], starts[s] + lengths[s])
        rows.append(own if parents[s] < 0 else np.concatenate([rows[parents[s]], own]))
    # A branch's queries in pieces of QUERY_CHUNK: each piece sees the keys up to its own last
    # query, so the masked kernel computes at most a piece-sized triangle it throws away.
    shapes: dict[tuple[int, int], list[tuple[int, np.ndarray]]] = {}
    for s in range(n):
        step = lengths[s] if parents[s] < 0 else QUERY_CHUNK
        for a in range(0, lengths[s], step):
            b = min(a + step, lengths[s])
            keys_of = rows[s][: len(rows[s]) - lengths[s] + b]
            shapes.setdefault((depths[s] + a, b - a), []).append((starts[s] + a, keys_of))
    groups = []
    for (depth, length), members in sorted(shapes.items()):
        keys = None
        if depth:
            keys = torch.from_numpy(np.stack([k for _, k in members])).to(device)
        groups.append(
            TreeGroup(depth=depth, length=length, starts=tuple(a for a, _ in members), keys=keys)
        )
    sizes = [len(r) for r in rows]
    cu = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    return TreeSpans(
        segments=make_segments(list(lengths), device),
        parents=tuple(parents),
        depths=tuple(depths),
        groups=tuple(groups),
        keys=torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, np.int64)).to(device),
        cu_keys=torch.from_numpy(cu).to(device),
        max_keys=max(sizes, default=0),
    )


def tree_allowed(tree: TreeSpans) -> torch.Tensor:
    """Dense ``[S, S]`` bool, canonical order: a token sees its ancestors' tokens and the tokens
    of its span up to itself."""
    rows = tree.keys.tolist()
    cu = tree.cu_keys.tolist()
    bounds = tree.segments.bounds
    allowed = torch.zeros(bounds[-1], bounds[-1], dtype=torch.bool)
    for s in range(len(bounds) - 1):
        keys = rows[cu[s] : cu[s + 1]]
        depth = tree.depths[s]
        for i, q in enumerate(range(bounds[s], bounds[s + 1])):
            allowed[q, keys[: depth + i + 1]] = True
    return allowed.to(tree.keys.device)


def tree_mask(
    depth: int,
    length: int,
    *,
    window: int | None,
    chunk: int | None,
    device: torch.device,
) -> torch.Tensor | None:
    """``[length, depth + length]`` bool: query ``i`` (at depth ``depth + i``) may see key ``j``
    (at depth ``j``); None for plain causal attention of a root span."""
    if depth == 0 and window is None and chunk is None:
        return None
    q = torch.arange(depth, depth + length, device=device)[:, None]
    k = torch.arange(depth + length, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    if chunk is not None:
        allowed &= q // chunk == k // chunk
    return allowed


def attend_tree(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: TreeSpans,
    *,
    scale: float | None,
    dropout: float,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree attention (see the module doc). q ``[1, H, S, dk]``, k ``[1, KV, S, dk]``, v
    ``[1, KV, S, dv]`` in canonical order -> ``[1, H, S, dv]``."""
    if chunk is None and segment_kernel(query, value, sinks=sinks, dropout=dropout) == "varlen":
        kernel = varlen_kernel()
        assert kernel is not None
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [S, heads, d]
        k, v = (x.index_select(0, spans.keys).contiguous() for x in (k, v))
        out = kernel(
            q.contiguous(),
            k,
            v,
            spans.segments.cu_seqlens,
            spans.segments.max_length,
            scale=scale,
            left=-1 if window is None else window - 1,
            gqa=query.shape[1] != key.shape[1],
            cu_k=spans.cu_keys,
            max_k=spans.max_keys,
        )
        return out.transpose(0, 1)[None]
    return _sdpa_tree(
        query,
        key,
        value,
        spans,
        scale=scale,
        dropout=dropout,
        window=window,
        chunk=chunk,
        sinks=sinks,
    )


def _sdpa_tree(query, key, value, spans, *, scale, dropout, window, chunk, sinks):
    gqa = query.shape[1] != key.shape[1]
    pieces: dict[int, torch.Tensor] = {}
    for g in spans.groups:
        n, total = len(g.starts), g.depth + g.length
        q = torch.cat([query[:, :, s : s + g.length] for s in g.starts])  # [n, H, L, dk]
        if g.keys is None:
            k = torch.cat([key[:, :, s : s + g.length] for s in g.starts])
            v = torch.cat([value[:, :, s : s + g.length] for s in g.starts])
        else:
            flat = g.keys.reshape(-1)
            k = key[0].index_select(1, flat).view(key.shape[1], n, total, -1).transpose(0, 1)
            v = value[0].index_select(1, flat).view(value.shape[1], n, total, -1).transpose(0, 1)
        mask = tree_mask(g.depth, g.length, window=window, chunk=chunk, device=q.device)
        if sinks is not None:  # the sink column: a zero key and a zero value
            if mask is None:
                mask = torch.ones(g.length, total, dtype=torch.bool, device=q.device).tril()
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            bias = bias.masked_fill(~mask, float("-inf")).expand(sinks.numel(), -1, -1)
            column = sinks.to(q.dtype).view(-1, 1, 1).expand(-1, g.length, 1)
            mask = torch.cat([bias, column], dim=-1)[None]
            k, v = (torch.cat([x, x.new_zeros(*x.shape[:2], 1, x.shape[3])], dim=2) for x in (k, v))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        for s, part in zip(g.starts, out.split(1, dim=0), strict=True):
            pieces[s] = part
    return torch.cat([pieces[s] for s in sorted(pieces)], dim=2)
