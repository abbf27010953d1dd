"""PolicyScorer: score a micro batch with an HF causal LM over the recorded sampling support.

One call runs the model's own forward on this rank's tokens (packed block-causal attention, the
Ulysses all-to-all inside attention when the row is split over a ``cp`` group, router replay when
routing is given) with the LM head's forward swapped, for the call, for
:func:`fused_support_logprobs` (:mod:`rollfeed.models.support_head`): FSDP2 and DTensor hooks fire
as in training, a DTensor head sharded on the vocabulary is scored vocabulary-parallel, and no
``[N, V]`` logits exist. The per-token results are gathered into canonical coordinates of the
whole row, as one :class:`~rollfeed.models.SupportScores`.

Coordinates, for ``S = 6``, ``cp = 2``, contiguous shards (``rollfeed.collate.TensorMicroBatch``)::

    rank 0: positions [0, 1, 2]   rank 1: positions [3, 4, 5]
    result.logprobs [6]: entry j scores labels[j] = input_ids[j + 1] under the support of row j

Every rank of the ``cp`` group gets the same ``[S]`` result; compute the same loss from it on each
rank and sum parameter gradients over the ``cp`` group (as a data-parallel all-reduce would).

A micro batch holding prefix trees (``TensorMicroBatch.tree``) runs the forward on its tree row
(each shared prefix once; :mod:`rollfeed.models.tree_attention`, routes replayed once per
prefix) and scores its flat rows, each from the hidden state of its tree token (the last token of
a shared prefix once per branch, against that branch's label and support): every result is in
flat canonical coordinates, as if the samples had been packed one by one, and ``[S]`` is the flat
row's length. Ranks then hold different numbers of flat rows.

``support_logprobs`` (``return_support_logprobs=True``) is *not* gathered: it holds this rank's own
``N`` rows, aligned slot for slot with the support the rank gave (``fields["sampling_mask"]``,
this rank's window). A loss term over it is this rank's part of the row's loss: each rank computes
the term over its own rows, and the parameter gradients summed over the ``cp`` group (as for the
gathered scores) are exactly the gradient of the sum of the ranks' terms (the attention's
all-to-all carries each rank's part back to the positions it depends on).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rollfeed.collate import RaggedRows
from rollfeed.deprecation import renamed_keywords
from rollfeed.models.candidates import MissingLabel
from rollfeed.models.cp_group import CPGroup
from rollfeed.models.errors import (
    CPMismatchError,
    PackingError,
    RoutingReplayError,
    TemperatureError,
    VocabularyRangeError,
)
from rollfeed.models.fused import DEFAULT_CHUNK_SIZE
from rollfeed.models.head_shard import head_vocab_size
from rollfeed.models.packing_attention import packed_layout, register_packed_attention
from rollfeed.models.packing_modules import install_packed_forwards
from rollfeed.models.packing_support import check_packable
from rollfeed.models.router_replay import RouterReplay, Routing, find_routers
from rollfeed.models.segments import segment_count
from rollfeed.models.support import RENAMED_KEYWORDS, SupportScores, support_logprobs
from rollfeed.models.support_checks import support_rows
from rollfeed.models.support_head import HeadCall, check_head, support_head
from rollfeed.models.tp import ProcessGroup
from rollfeed.models.ulysses import gather_rank_order, gather_sequence, gather_uneven
from rollfeed.models.vision import check_placeholders, find_vision, image_features, tower_sharded

if TYPE_CHECKING:
    from rollfeed.collate import MediaBatch, TensorMicroBatch, TreeBatch

logger = logging.getLogger(__name__)


class PolicyScorer:
    """Wraps an HF causal LM (``...ForCausalLM``) for support-conditioned scoring.

    The model may be plain, sharded with FSDP2 (``fully_shard``) and/or tensor-parallel with
    DTensor (``parallelize_module``): scoring runs its own forward. ``cp``: this rank's
    :class:`~rollfeed.models.CPGroup`, the ranks a packed row is split over
    (``CPGroup.from_topology(topo, group=cp_pg)``, or :meth:`from_mesh`;
    default: none, the whole row is local); attention runs Ulysses over it. A DTensor LM-head
    weight placed ``Shard(0)`` is scored vocabulary-parallel over its mesh, ``Replicate()`` as
    unsharded (:mod:`rollfeed.models.head_shard`). ``tp_group`` / ``vocab_start``: a plain-tensor
    vocabulary shard (Megatron-style heads) whose local weight holds rows
    ``[vocab_start, vocab_start + V_local)``. ``replay_weights``:
    replay recorded routing weights too, when the micro batch carries them; ``drift_ratio``: the
    router replay's drift guard (:class:`~rollfeed.models.RouterReplay`, off when None; replaced
    slots counted in ``metrics["slots_replaced"]``). Switches the model's
    attention to the packed implementation (:mod:`rollfeed.models.packing_attention`) and runs
    its Gated DeltaNet and Llama-4 NoPE layers with packed forwards of their own
    (:mod:`rollfeed.models.packing_modules`). A vision-language model (Qwen3-VL, Qwen3-VL-MoE)
    scores micro batches with images (``TensorMicroBatch.media``): its forward embeds them, its
    vision tower's work spread over ``cp`` (:mod:`rollfeed.models.vision`); the tower keeps its
    own attention (sdpa, within each image).

    Refuses, with :class:`~rollfeed.models.UnpackableAttentionError` naming each layer and
    feature, a model that packing over ``cp`` cannot reproduce exactly (state-space mixers,
    soft-capping, key heads ``cp`` cannot split, ...: :mod:`rollfeed.models.packing_support`),
    and with
    :class:`~rollfeed.models.LMHeadError` a head the scorer cannot replace exactly (a bias, logits
    transformed after the head). ``vocab_size`` is the full vocabulary, found once here (a DTensor
    head's global shape; a plain shard under ``tp_group``: one all-reduce of the shards' widths,
    so every TP rank constructs its scorer at the same point).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        cp: CPGroup | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        compute_entropy: bool = False,
        entropy_requires_grad: bool = False,
        missing_label: MissingLabel = "error",
        replay_weights: bool = False,
        drift_ratio: float | None = None,
        tp_group: ProcessGroup | None = None,
        vocab_start: int = 0,
    ) -> None:
        self.model = model
        self.cp = cp or CPGroup()
        self.chunk_size = chunk_size
        self.compute_entropy = compute_entropy
        self.entropy_requires_grad = entropy_requires_grad
        self.missing_label: MissingLabel = missing_label
        self.tp_group = tp_group
        self.vocab_start = vocab_start
        check_packable(model, self.cp.size)
        self.head = check_head(model)
        self.vocab_size = head_vocab_size(
            self.head.weight, tp_group=tp_group, vocab_start=vocab_start
        )
        self.vision = find_vision(model)
        if self.vision is None:
            model.set_attn_implementation(register_packed_attention())
        else:  # the tower attends within each image, as its sdpa path does (one call each)
            model.set_attn_implementation(
                {"text_config": register_packed_attention(), "vision_config": "sdpa"}
            )
        install_packed_forwards(model)
        self.attention_chunk = _attention_chunk(model)
        self.replay = (
            RouterReplay(model, replay_weights=replay_weights, drift_ratio=drift_ratio)
            if find_routers(model)
            else None
        )

    @classmethod
    def from_mesh(cls, model: nn.Module, mesh: Any, **options: Any) -> PolicyScorer:
        """A scorer whose ``cp`` group is the ``cp`` dimension of the trainer's named
        ``DeviceMesh`` (:meth:`CPGroup.from_mesh`, the axis table of
        :mod:`rollfeed.collate.mesh_axes`); ``options`` as in the constructor. A tensor-parallel
        head is read from its DTensor weight, so ``tp`` needs nothing here."""
        return cls(model, cp=CPGroup.from_mesh(mesh), **options)

    @renamed_keywords("PolicyScorer.score_tokens", **RENAMED_KEYWORDS)
    def score_tokens(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        support: RaggedRows | torch.Tensor,
        *,
        temperature: float | torch.Tensor = 1.0,
        routing: Routing | None = None,
        canonical_index: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        fallback_mask: torch.Tensor | None = None,
        return_support_logprobs: bool = False,
        media: MediaBatch | None = None,
        tree: TreeBatch | None = None,
    ) -> SupportScores:
        """Score this rank's ``N`` tokens and gather the row (``[S]``, ``S = N * cp.size``).

        ``input_ids, position_ids [N]``; ``labels [N]`` (next token of each input position);
        ``support``: :class:`~rollfeed.collate.RaggedRows` of ``N`` rows of int ids, or a padded
        ``[N, W]`` tensor (``-1`` pads; see :func:`~rollfeed.models.support_logprobs`);
        ``temperature`` scalar or ``[N]``; ``routing`` over the same ``N`` input positions;
        ``canonical_index [N]`` / ``cu_seqlens [B+1]`` as in
        :func:`rollfeed.models.packing_attention.packed_layout`; ``fallback_mask [N]`` rows scored
        over the full vocabulary; ``return_support_logprobs``: also return this rank's
        ``support_logprobs`` (local rows, aligned with ``support``; see the module doc).
        ``media``: the micro batch's images (:class:`~rollfeed.collate.MediaBatch`) for a
        vision-language model: embedded in the model's forward, the vision tower's work spread
        over ``cp`` (:mod:`rollfeed.models.vision`); ``position_ids`` stays the one-axis
        position and the model takes ``media.mrope_position_ids``.
        ``tree``: the micro batch's tree row (:class:`~rollfeed.collate.TreeBatch`): then
        ``input_ids``, ``position_ids`` and ``routing`` are its tokens', every other per-row input
        and ``canonical_index`` are the flat rows' (see the module doc).
        """
        support = support_rows(support, labels.shape[0])
        spans = None if tree is None else (tree.starts, tree.depths, tree.lengths, tree.parents)
        layout = packed_layout(
            position_ids,
            cp=self.cp,
            canonical_index=canonical_index if tree is None else tree.positions,
            cu_seqlens=cu_seqlens if tree is None else None,
            chunk_size=self.attention_chunk,
            tree=spans,
        )
        zero = torch.zeros((), dtype=torch.int64, device=input_ids.device)
        metrics = {"rows_replayed": zero, "rows_fallen_back": zero, "slots_replaced": zero}
        if routing is not None:
            if self.replay is None:
                raise RoutingReplayError(
                    f"routing given but {type(self.model).__name__} has no MoE router to replay; "
                    "score a dense model without routing",
                    tensor="routed_experts",
                )
            metrics.update(self.replay.set(routing))
        elif self.replay is not None:
            self.replay.clear()  # a routing left set for a checkpointed backward is stale now
        call = HeadCall(
            labels=_safe_labels(labels, support, fallback_mask),
            support=support,
            temperature=temperature,
            fallback_mask=fallback_mask,
            chunk_size=self.chunk_size,
            compute_entropy=self.compute_entropy,
            entropy_requires_grad=self.entropy_requires_grad,
            return_support_logprobs=return_support_logprobs,
            missing_label=self.missing_label,
            tp_group=self.tp_group,
            vocab_start=self.vocab_start,
            vocab_size=self.vocab_size,
            rows=None if tree is None else tree.rows,
        )
        site = self.vision
        if media is not None and site is None:
            raise PackingError(
                f"the micro batch holds images but {type(self.model).__name__} has no vision "
                "tower; score it with the vision-language model the rollout was sampled with",
                tensor="pixel_values",
            )
        dummy = site is not None and tower_sharded(site)
        vision = (
            image_features(site, media, self.cp, order=layout.order, dummy=dummy)
            if site is not None and (media is not None or dummy)
            else nullcontext(None)
        )
        try:
            with support_head(self.head, call) as read, vision as seen:
                inputs = {"position_ids": position_ids.reshape(1, -1)}
                inputs.update({} if seen is None else seen.kwargs)
                out = self.model(
                    input_ids=input_ids.reshape(1, -1), packing=layout, use_cache=False, **inputs
                )
                scores = read(out.logits)
        finally:
            # With activation checkpointing the backward recomputes the forward and must replay
            # again; the routing then stays set until the next call.
            if routing is not None and not _checkpointing(self.model):
                self.replay.clear()
        metrics.update(scores.metrics)
        if site is not None:
            counts = {} if seen is None else seen.counts
            for name in ("images_encoded", "vision_patches"):
                metrics[name] = torch.tensor(counts.get(name, 0), device=input_ids.device)
        return self._gather(
            scores, canonical_index, metrics, counts=None if tree is None else tree.flat_counts
        )

    @renamed_keywords("PolicyScorer.score", **RENAMED_KEYWORDS)
    def score(
        self,
        micro_batch: TensorMicroBatch,
        *,
        fallback_unsupported: bool = False,
        return_support_logprobs: bool = False,
    ) -> SupportScores:
        """:meth:`score_tokens` on this rank's :class:`rollfeed.collate.TensorMicroBatch`.

        Support comes from ``fields["sampling_mask"]`` (:class:`~rollfeed.collate.RaggedRows` or a
        padded tensor; all rows invalid when absent), routing from
        ``fields["routed_experts"]`` (and ``routed_expert_weights``). ``fallback_unsupported``:
        score loss-bearing rows that have no recorded support over the full vocabulary (counted in
        ``rows_fallback``) instead of leaving them invalid. ``return_support_logprobs``: also return
        ``support_logprobs``, this rank's rows aligned slot for slot with
        ``fields["sampling_mask"]`` (the label's slot first where the read put it first).

        Before the forward, the values the collator recorded on the CPU (``micro_batch.checks``)
        are compared with this scorer's vocabulary: a token id outside ``[0, V)`` raises
        :class:`~rollfeed.models.VocabularyRangeError`, an invalid temperature on a scored row
        :class:`~rollfeed.models.TemperatureError`, both naming the place. Plain Python values:
        no device sync. A micro batch split for another ``cp`` rank or size than this scorer's
        ``cp`` group raises :class:`~rollfeed.models.CPMismatchError`.
        """
        mb = micro_batch
        self._check_cp(mb)
        self._check_recorded(mb)
        n = mb.input_ids.numel()
        support = mb.fields.get("sampling_mask")
        if support is None:
            device = mb.input_ids.device
            offsets = torch.zeros(n + 1, dtype=torch.int64, device=device)
            support = RaggedRows(offsets, torch.zeros(0, dtype=torch.int32, device=device))
        support = support_rows(support, n)
        routing = None
        if "routed_experts" in mb.fields:
            # Replay what was recorded: the rows the read found (coverage), never guessed.
            covered = mb.coverage.get("routed_experts")
            if covered is None:
                raise RoutingReplayError(
                    "the micro batch carries routed_experts without its coverage; build it with "
                    "to_tensor_micro_batch or give coverage['routed_experts'] ([N] bool)",
                    tensor="routed_experts",
                )
            weights = mb.fields.get("routed_expert_weights")
            if weights is not None and self.replay is not None and self.replay.replay_weights:
                covered = covered & mb.coverage["routed_expert_weights"]
            routing = Routing(experts=mb.fields["routed_experts"], covered=covered, weights=weights)
        elif mb.is_dummy and self.replay is not None:
            # No recorded rows: every row keeps the model's routing and is counted as such.
            shape = (mb.input_ids.numel(), self.replay.layers, self.replay.top_k)  # flat: no tree
            device = mb.input_ids.device
            routing = Routing(
                experts=torch.zeros(shape, dtype=torch.uint8, device=device),
                covered=torch.zeros(shape[0], dtype=torch.bool, device=device),
                weights=torch.zeros(shape, dtype=torch.float32, device=device),
            )
        fallback = None
        if fallback_unsupported:
            fallback = mb.loss_mask & ~_has_ids(support)
        if mb.media is not None and self.vision is not None:
            check_placeholders(self.vision, mb)
        tree = mb.tree
        return self.score_tokens(
            mb.input_ids if tree is None else tree.input_ids,
            mb.position_ids if tree is None else tree.position_ids,
            mb.labels,
            support,
            temperature=mb.temperatures,
            routing=routing,
            canonical_index=mb.positions,
            cu_seqlens=mb.cu_seqlens,
            fallback_mask=fallback,
            return_support_logprobs=return_support_logprobs,
            media=mb.media,
            tree=tree,
        )

    def _check_cp(self, mb: TensorMicroBatch) -> None:
        cp = self.cp
        if (mb.cp_rank, mb.cp_size) != (cp.rank, cp.size):
            raise CPMismatchError(
                f"the micro batch was split for cp rank {mb.cp_rank} of {mb.cp_size} "
                f"({mb.cp_layout}), this scorer runs cp rank {cp.rank} of {cp.size}; plan with "
                f"PlanConfig(cp_size={cp.size}) and read with this rank's Topology.cp_rank"
            )
        if mb.fields_whole:
            raise CPMismatchError(
                "score() needs fields over this rank's cp windows, the micro batch holds them over "
                "the whole row; build the TensorMicroBatch with whole_fields=False"
            )

    def _check_recorded(self, mb: TensorMicroBatch) -> None:
        checks = mb.checks
        if checks is None:  # built by hand: the scorer's checks of the tensors still apply
            return
        vocab = self.vocab_size
        for found in (checks.max_id, checks.min_id):
            if found is not None and not 0 <= found.value < vocab:
                raise VocabularyRangeError(
                    f"token id {found.value} in {found} is outside the vocabulary [0, {vocab}) "
                    f"of {type(self.model).__name__}; score with the model (and tokenizer) the "
                    "rollout was sampled with",
                    tensor=found.tensor,
                    pos=found.pos,
                    sample=found.sample,
                )
        bad = checks.bad_temperature
        if bad is not None:
            raise TemperatureError(
                f"temperature {bad.value} in {bad} is not finite and > 0 on a scored row; record "
                "the sampler's temperature for every sampled token",
                tensor=bad.tensor,
                pos=bad.pos,
                sample=bad.sample,
            )

    def score_logits(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        support: RaggedRows | torch.Tensor,
        **options: object,
    ) -> SupportScores:
        """Plain logits ``[N, V]`` -> :func:`support_logprobs` with this scorer's options."""
        options.setdefault("compute_entropy", self.compute_entropy)
        options.setdefault("entropy_requires_grad", self.entropy_requires_grad)
        options.setdefault("missing_label", self.missing_label)
        options.setdefault("tp_group", self.tp_group)
        options.setdefault("vocab_start", self.vocab_start)
        options.setdefault("vocab_size", self.vocab_size)
        return support_logprobs(logits, labels, support, **options)  # type: ignore[arg-type]

    def _gather(
        self,
        scores: SupportScores,
        canonical_index: torch.Tensor | None,
        metrics: dict[str, torch.Tensor],
        *,
        counts: tuple[int, ...] | None = None,
    ) -> SupportScores:
        cp = self.cp
        if counts is not None:  # a tree row: ranks hold different numbers of flat rows
            assert canonical_index is not None
            gather = lambda x: gather_uneven(x, cp, counts, canonical_index=canonical_index)  # noqa: E731
            entropy = scores.entropy
            return SupportScores(
                logprobs=gather(scores.logprobs),
                entropy=None if entropy is None else gather(entropy),
                valid_mask=gather(scores.valid_mask.to(torch.uint8)).bool(),
                support_logprobs=scores.support_logprobs,
                metrics=metrics,
            )
        if canonical_index is None and cp.enabled:
            n = scores.logprobs.shape[0]
            canonical_index = cp.rank * n + torch.arange(n, device=scores.logprobs.device)
        valid = gather_rank_order(scores.valid_mask.to(torch.uint8), cp)
        if canonical_index is not None:
            order = gather_rank_order(canonical_index.to(torch.long), cp)
            valid = valid[torch.argsort(order)]
        entropy = scores.entropy
        return SupportScores(
            logprobs=gather_sequence(scores.logprobs, cp, canonical_index=canonical_index),
            entropy=None
            if entropy is None
            else gather_sequence(entropy, cp, canonical_index=canonical_index),
            valid_mask=valid.bool(),
            support_logprobs=scores.support_logprobs,
            metrics=metrics,
        )


def _attention_chunk(model: nn.Module) -> int | None:
    """The chunk of the model's chunked-attention layers (Llama-4), or None when it has none."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if "chunked_attention" in (getattr(text, "layer_types", None) or ()):
        return text.attention_chunk_size
    return None


def _checkpointing(model: nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _has_ids(support: RaggedRows) -> torch.Tensor:
    """``[N]`` bool: rows holding an id (not only ``-1`` padding)."""
    return segment_count(support.values >= 0, support.row_index(), support.n_rows) > 0


def _safe_labels(
    labels: torch.Tensor, support: RaggedRows, fallback_mask: torch.Tensor | None
) -> torch.Tensor:
    # Rows with no label (sample ends, padding) carry IGNORE_INDEX; they have no support and are
    # not scored, so any in-range id stands in for the scorer's range check.
    unscored = ~_has_ids(support)
    if fallback_mask is not None:
        unscored &= ~fallback_mask
    return torch.where(unscored & (labels < 0), torch.zeros_like(labels), labels)
