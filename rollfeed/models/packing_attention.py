"""Attention over packed micro batches, optionally split over the ``cp`` group (Ulysses).

A packed row holds several samples back to back. A token may attend only to earlier tokens of its
own sample (block-diagonal causal attention). Rather than a dense ``[S, S]`` mask (256 MiB at
S = 16,384, and it keeps SDPA off its fused kernels), attention puts the tokens in *canonical
order* (their positions in the whole pre-split row), runs causal SDPA on each sample's slice and
puts the result back in the order the tokens arrived in (rank order under cp > 1, zigzag included).
The kernels are in :mod:`rollfeed.models.segment_attention`: on CUDA one varlen call over the
whole row, elsewhere (and for features the varlen kernels lack) causal SDPA per sample, samples of
equal length batched. A sliding-window layer (gpt-oss alternates them) is a per-sample band;
attention sinks (gpt-oss) are one extra key/value column per sample whose logit is the head's
sink; MLA's value head size may differ from the query/key size (DeepSeek-V3); a chunked layer
(Llama-4's ``chunked_attention``) attends within chunks of ``attention_chunk_size`` tokens counted
from each sample's first token, which is causal attention over the row cut into those chunks
(:attr:`PackedLayout.chunks`). Masks are always per sample, never ``[S, S]``.

Example, row = sample A (3 tokens) + sample B (2 tokens), canonical order::

    lengths = [3, 2]                  bounds = (0, 3, 5)
    out[0:3] = sdpa(q[0:3], k[0:3], v[0:3], is_causal=True)
    out[3:5] = sdpa(q[3:5], k[3:5], v[3:5], is_causal=True)   # token 3 attends only to itself

A row holding prefix trees (``packed_layout(..., tree=...)``) is attended by
:func:`~rollfeed.models.tree_attention.attend_tree`: each span sees its ancestors and itself
causally, windows and chunks counted along each path.

The attention function plugs into transformers' registry under :data:`PACKED_ATTENTION`; the model
forward receives the layout as the keyword argument ``packing=PackedLayout`` and hands it down to
every attention call (transformers forwards extra keyword arguments to the attention function).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rollfeed.models.cp_group import CPGroup
from rollfeed.models.errors import PackingError
from rollfeed.models.row_segments import Segments, make_segments
from rollfeed.models.segment_attention import attend_segments
from rollfeed.models.tree_attention import TreeSpans, attend_tree, tree_allowed, tree_spans
from rollfeed.models.ulysses import gather_rank_order, heads_to_seq, seq_to_heads

logger = logging.getLogger(__name__)

PACKED_ATTENTION = "rollfeed_packed"


def chunk_lengths(lengths: list[int], chunk: int) -> list[int]:
    """Each sample cut into chunks of ``chunk`` tokens counted from its first token.

    Example: lengths [5, 2], chunk 2 -> [2, 2, 1, 2].
    """
    return [min(chunk, n - a) for n in lengths for a in range(0, n, chunk)]


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedLayout:
    """What attention needs to know about one packed row of ``S`` tokens.

    ``order [S]`` long: the canonical index of each token, in the order tokens reach attention.
    ``inverse [S]`` long: the arriving token at each canonical index (``None`` when the tokens
    arrive in canonical order). ``samples``: the row's samples (:class:`Segments`);
    ``chunks``: the samples cut into chunks of ``chunk_size`` tokens for chunked-attention
    layers, or None. ``position_ids [S/cp]``: this rank's position ids, as given. ``cp``: the
    ``cp`` group the row is split over (size 1 when the whole row is local). ``tree``: the spans
    of a row holding prefix trees (:class:`~rollfeed.models.tree_attention.TreeSpans`; then
    ``samples`` are those spans), or None. Build it once per forward with :func:`packed_layout`;
    attention then needs no host sync.
    """

    order: torch.Tensor
    inverse: torch.Tensor | None
    samples: Segments
    chunks: Segments | None
    chunk_size: int | None
    position_ids: torch.Tensor
    cp: CPGroup
    tree: TreeSpans | None = None

    @property
    def bounds(self) -> tuple[int, ...]:
        return self.samples.bounds

    @property
    def groups(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        return self.samples.groups

    @property
    def length(self) -> int:
        return self.bounds[-1]

    @property
    def allowed(self) -> torch.Tensor:
        """Dense ``[S, S]`` bool view, arrival order: query i may attend key j. For inspection and
        reference checks only; attention never builds it (``S²`` bytes)."""
        order = self.order
        if self.tree is not None:
            return tree_allowed(self.tree)[order][:, order]
        lengths = torch.tensor(self.bounds, device=order.device).diff()
        samples = torch.arange(lengths.numel(), device=order.device)
        segment = torch.repeat_interleave(samples, lengths)[order]
        return (segment[:, None] == segment[None, :]) & (order[None, :] <= order[:, None])


def segment_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """``[S]`` position ids restarting at 0 per sample (canonical order) -> ``[S]`` segment ids.

    Example: positions [0, 1, 2, 0, 1] -> segments [0, 0, 0, 1, 1]. The first token always opens a
    segment, even when a truncated row does not start at position 0.
    """
    starts = position_ids == 0
    starts[:1] = True
    return torch.cumsum(starts.to(torch.long), 0) - 1


def _sample_lengths(
    local: torch.Tensor,
    order: torch.Tensor,
    inverse: torch.Tensor | None,
    cp: CPGroup,
    cu_seqlens: torch.Tensor | None,
) -> list[int]:
    """Lengths of the row's non-empty samples, canonical order."""
    total = order.numel()
    if cu_seqlens is not None:
        # The sample lengths set the shapes of the per-sample attention calls, so they are read
        # on the host: one copy (the one host sync of the layout when cu_seqlens lives on a
        # device), and the checks run on that copy.
        bounds = cu_seqlens.to(device="cpu", dtype=torch.long)
        if bounds[0] != 0 or bounds[-1] < total or (bounds.diff() < 0).any():
            raise PackingError(
                f"cu_seqlens must start at 0, be non-decreasing and reach the row length "
                f"{total}; got {bounds.tolist()}",
                tensor="cu_seqlens",
            )
        # Samples past the row's end were truncated away: clip them to the row.
        lengths = bounds.clamp(max=total).diff()
    else:
        positions = gather_rank_order(local, cp)
        canonical = positions if inverse is None else positions[inverse]
        lengths = torch.bincount(segment_ids_from_positions(canonical))
    return [n for n in lengths.tolist() if n > 0]  # without cu_seqlens: the layout's one sync


def packed_layout(
    position_ids: torch.Tensor,
    *,
    cp: CPGroup | None = None,
    canonical_index: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int | None = None,
    tree: tuple[tuple[int, ...], ...] | None = None,
) -> PackedLayout:
    """The attention layout of this rank's tokens ``position_ids [S/cp]``.

    ``cp``: the ``cp`` group the row is split over (default: none, the whole row is local).
    ``canonical_index [S/cp]``: each local token's index in the whole row (default: contiguous
    shards, ``cp.rank * S/cp + arange``). ``cu_seqlens [B+1]``: sample boundaries of the whole row;
    without it, samples are read off the position ids (a reset to 0 opens a sample), which needs the
    tokens of each sample in canonical order, so give ``cu_seqlens`` for zigzag layouts.
    ``chunk_size``: the chunk of the model's chunked-attention layers, if it has any.
    ``tree``: for a row holding prefix trees, its spans as ``(starts, depths, lengths, parents)``
    (:class:`~rollfeed.collate.TreeBatch`); ``cu_seqlens`` is then not needed.

    Example: positions [0, 1, 2, 0, 1, 0, 1], cp 1 -> bounds (0, 3, 5, 7),
    groups ((2, (3, 5)), (3, (0,))), inverse None; with chunk_size 2 the chunks' bounds are
    (0, 2, 3, 5, 7).
    """
    cp = cp or CPGroup()
    local = position_ids.reshape(-1).to(torch.long)
    if canonical_index is None:
        canonical_index = cp.rank * local.numel() + torch.arange(local.numel(), device=local.device)
    elif canonical_index.numel() != local.numel():
        raise PackingError(
            f"canonical_index has {canonical_index.numel()} entries for {local.numel()} tokens; "
            "give one canonical index per local token",
            tensor="canonical_index",
        )
    order = gather_rank_order(canonical_index.reshape(-1).to(torch.long), cp)
    ranks = torch.arange(order.numel(), device=order.device)
    sorted_order, inverse = torch.sort(order)
    if not torch.equal(sorted_order, ranks):
        raise PackingError(
            f"canonical_index must be a permutation of 0..{order.numel() - 1} across the cp "
            "group; got duplicates or gaps",
            tensor="canonical_index",
        )
    in_canonical_order = torch.equal(order, ranks)
    if chunk_size is not None and (isinstance(chunk_size, bool) or chunk_size < 1):
        raise PackingError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    device = order.device
    if tree is not None:
        spans = tree_spans(*tree, device)
        if spans.length != order.numel():
            raise PackingError(
                f"the tree's spans cover {spans.length} tokens, the row holds {order.numel()}",
                tensor="tree",
            )
        return PackedLayout(
            order=order,
            inverse=None if in_canonical_order else inverse,
            samples=spans.segments,
            chunks=None,
            chunk_size=chunk_size,
            position_ids=local,
            cp=cp,
            tree=spans,
        )
    lengths = _sample_lengths(local, order, None if in_canonical_order else inverse, cp, cu_seqlens)
    return PackedLayout(
        order=order,
        inverse=None if in_canonical_order else inverse,
        samples=make_segments(lengths, device),
        chunks=None
        if chunk_size is None
        else make_segments(chunk_lengths(lengths, chunk_size), device),
        chunk_size=chunk_size,
        position_ids=local,
        cp=cp,
    )


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    packing: PackedLayout,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q ``[B, H, S/cp, dk]``, k ``[B, KV, S/cp, dk]``, v
    ``[B, KV, S/cp, dv]`` -> ``[B, S/cp, H, dv]``. ``attention_mask`` from transformers is
    ignored: ``packing`` replaces it. Exact for sliding windows (``sliding_window``, per sample),
    attention sinks (``s_aux``, gpt-oss: ``[H]`` logits, split with the heads under cp) and
    chunked layers (``module.config.layer_types[module.layer_idx] == "chunked_attention"``: the
    layout's chunks, which must be of the model's ``attention_chunk_size``).
    """
    del attention_mask
    window = kwargs.get("sliding_window")
    sinks = kwargs.get("s_aux")
    cp = packing.cp
    heads, kv_heads = query.shape[1], key.shape[1]
    if cp.enabled and kv_heads % cp.size:
        # Fewer KV heads than ranks: replicate each KV head for its query group so the split lines
        # up with the query heads' split (costs bandwidth, keeps the math exact).
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    query = seq_to_heads(query, cp, seq_dim=2, head_dim=1)
    key = seq_to_heads(key, cp, seq_dim=2, head_dim=1)
    value = seq_to_heads(value, cp, seq_dim=2, head_dim=1)
    if isinstance(sinks, torch.Tensor) and cp.enabled:
        sinks = sinks.chunk(cp.size)[cp.rank]  # this rank's heads (seq_to_heads keeps them)
    if packing.length != query.shape[2]:
        raise PackingError(
            f"packing layout covers {packing.length} tokens, attention sees "
            f"{query.shape[2]}; build the layout from this forward's position ids",
            layer=getattr(module, "layer_idx", None),
        )
    if packing.inverse is not None:
        query, key, value = (x.index_select(2, packing.inverse) for x in (query, key, value))
    options = {
        "scale": scaling,
        "dropout": dropout if module.training else 0.0,
        "window": window if isinstance(window, int) else None,
        "sinks": sinks if isinstance(sinks, torch.Tensor) else None,
    }
    if packing.tree is None:
        out = attend_segments(query, key, value, _segments(module, packing), **options)
    else:
        chunk = _chunk(module, packing)
        out = attend_tree(query, key, value, packing.tree, chunk=chunk, **options)
    if packing.inverse is not None:
        out = out.index_select(2, packing.order)
    out = heads_to_seq(out, cp, seq_dim=2, head_dim=1)
    return out.transpose(1, 2).contiguous(), None


def _chunk(module: torch.nn.Module, packing: PackedLayout) -> int | None:
    """The chunk size ``module`` attends in (a chunked layer, checked against the layout's), or
    None."""
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if types is None or layer is None or types[layer] != "chunked_attention":
        return None
    chunk = config.attention_chunk_size
    if packing.chunk_size != chunk:
        raise PackingError(
            f"layer {layer} attends in chunks of {chunk} tokens, the packing layout was built "
            f"with chunk_size={packing.chunk_size}; build it with packed_layout(..., "
            f"chunk_size={chunk})",
            layer=layer,
        )
    return chunk


def _segments(module: torch.nn.Module, packing: PackedLayout) -> Segments:
    """The pieces ``module`` attends within: the samples, or their chunks on a chunked layer."""
    if _chunk(module, packing) is None:
        return packing.samples
    assert packing.chunks is not None  # a layout built with a chunk_size has its chunks
    return packing.chunks


def register_packed_attention() -> str:
    """Register :func:`packed_attention_forward` with transformers (idempotent); returns its name,
    for ``model.set_attn_implementation(name)`` or ``config._attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    return PACKED_ATTENTION
