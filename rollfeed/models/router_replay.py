"""Router replay for HF MoE models: run the experts the sampler ran (rollout routing replay, R3).

The sampler records, per token and MoE layer, the ``top_k`` expert ids it routed to
(``routed_experts [N, L, K]``, small ints). In the trainer forward each router's own top-k is
replaced by the recorded ids; the mixing weights are recomputed from the router's own logits over
those ids and renormalised as the model's config says, so gradients still reach the router.
Optionally the recorded weights (``routed_expert_weights [N, L, K]`` fp32) replace the mixing
weights too ("total router recall"); then no mixing gradient reaches the router. Idea: Ma et al.,
"Stabilizing MoE RL by aligning training and inference routers" (2025, arXiv:2510.11370).

Uncovered rows (positions the sampler never forwarded, e.g. the final sampled token or padding) are
stored as fill (``0``), which would read as "expert 0": they keep the model's own routing instead.
Coverage is given per row, or inferred: a real top-k row has ``K`` distinct ids in every layer, so a
row whose ids repeat in every layer is fill (this needs ``K >= 2``).

Example, K = 2, one layer, 4 experts, router probabilities of a token ``[.1, .2, .3, .4]``::

    own routing        ids [3, 2]  weights [.4/.7, .3/.7]   (norm_topk_prob)
    replayed ids [0, 3]            weights [.1/.5, .4/.5]   (router's own probs over those ids)
    replayed with recorded weights [0.25, 0.75]             (taken as given)

The hook sits on the router module (``...TopKRouter``: softmax over experts, top-k, optional
renormalisation) and rewrites its ``(logits, scores, indices)`` output, so the MoE block and its
expert kernels run unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from rollfeed.models.errors import RoutingReplayError

logger = logging.getLogger(__name__)

# Routers whose forward is softmax over all experts -> top-k -> optional renormalisation, returning
# (router_logits, scores, indices). Others (sigmoid scores, bias-corrected top-k) need other rules.
SOFTMAX_TOPK_ROUTERS = frozenset(
    {
        "MixtralTopKRouter",
        "Qwen2MoeTopKRouter",
        "Qwen3MoeTopKRouter",
        "Qwen3VLMoeTextTopKRouter",
        "Qwen3_5MoeTopKRouter",
        "OlmoeTopKRouter",
    }
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Routing:
    """Recorded routing of one forward's tokens (the ``inputs`` window of a micro batch).

    ``experts [N, L, K]`` uint8/uint16/int ids; ``weights [N, L, K]`` float or None; ``covered [N]``
    bool or None (inferred from repeated ids, see the module docstring).
    """

    experts: torch.Tensor
    weights: torch.Tensor | None = None
    covered: torch.Tensor | None = None


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in forward order (layer ``l`` of ``routed_experts`` is the l-th)."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    unknown = sorted({type(m).__name__ for m in routers} - SOFTMAX_TOPK_ROUTERS)
    if unknown:
        raise RoutingReplayError(
            f"router replay supports softmax-top-k routers {sorted(SOFTMAX_TOPK_ROUTERS)}; "
            f"this model has {unknown}"
        )
    return routers


def infer_coverage(experts: torch.Tensor) -> torch.Tensor:
    """``[N, L, K]`` ids -> ``[N]`` bool: a row is covered when its ids are distinct in every layer.

    A row repeating ids in some layers but not in others is corrupt and raises.
    Example (L=1, K=2): ``[[[3, 1]], [[0, 0]]]`` -> ``[True, False]``.
    """
    if experts.shape[-1] < 2:
        raise RoutingReplayError(
            "with top_k = 1 fill rows cannot be told from expert 0; pass Routing(covered=...)"
        )
    ids = experts.to(torch.long).sort(dim=-1).values
    distinct = (ids.diff(dim=-1) != 0).all(dim=-1)  # [N, L]
    covered = distinct.all(dim=-1)
    mixed = distinct.any(dim=-1) & ~covered
    if mixed.any():
        rows = mixed.nonzero()[:, 0].tolist()
        raise RoutingReplayError(
            f"routed_experts rows {rows[:10]} repeat ids in some layers only (corrupt routing); "
            "fill rows repeat them in every layer",
            tensor="routed_experts",
            pos=rows[0],
        )
    return covered


def replayed_router_output(
    router_logits: torch.Tensor,
    own_scores: torch.Tensor,
    own_indices: torch.Tensor,
    *,
    experts: torch.Tensor,
    covered: torch.Tensor,
    weights: torch.Tensor | None,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and indices ``[N, K]`` after replay.

    ``router_logits [N, E]``; ``experts [N, K]`` long; ``covered [N]`` bool; ``weights [N, K]`` or
    None (recompute from ``router_logits``). Uncovered rows keep ``own_scores`` / ``own_indices``.
    """
    if weights is None:
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        replay = probs.gather(1, experts)
        if renormalize:
            replay = replay / replay.sum(dim=-1, keepdim=True)
    else:
        replay = weights.to(torch.float32)
    keep = covered[:, None]
    scores = torch.where(keep, replay, own_scores.to(torch.float32)).to(own_scores.dtype)
    return scores, torch.where(keep, experts, own_indices)


class RouterReplay:
    """Hooks on every router of ``model`` that replay a :class:`Routing` while one is set.

    ``replay_weights=True`` takes ``Routing.weights`` as the mixing weights (it must then be given).
    With activation checkpointing, keep the routing set until backward has run (:meth:`set` /
    :meth:`clear`): the recomputed forward reads it again.
    """

    def __init__(self, model: nn.Module, *, replay_weights: bool = False) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise RoutingReplayError(
                f"{type(model).__name__} has no MoE router to replay (replay hooks the "
                "...TopKRouter modules of transformers >= 5)"
            )
        self.replay_weights = replay_weights
        self._routing: Routing | None = None
        self._covered: torch.Tensor | None = None
        self._record: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._handles = [
            router.register_forward_hook(self._hook(layer))
            for layer, router in enumerate(self.routers)
        ]

    def set(self, routing: Routing) -> dict[str, torch.Tensor]:
        """Replay ``routing`` in every forward until :meth:`clear`.

        Returns the row counters ``rows_replayed`` and ``rows_fallen_back``, 0-d int64 tensors
        (the convention of :mod:`rollfeed.models`).
        """
        experts = routing.experts
        layers, top_k = len(self.routers), self.routers[0].top_k
        if experts.ndim != 3 or tuple(experts.shape[1:]) != (layers, top_k):
            raise RoutingReplayError(
                f"routed_experts shape {tuple(experts.shape)} does not match the model's "
                f"[N, {layers} MoE layers, top_k {top_k}]; record the routing with this model",
                tensor="routed_experts",
            )
        if self.replay_weights and (
            routing.weights is None or routing.weights.shape != experts.shape
        ):
            raise RoutingReplayError(
                "replay_weights=True needs routed_expert_weights of the routed_experts shape "
                f"{tuple(experts.shape)}; got "
                f"{None if routing.weights is None else tuple(routing.weights.shape)}",
                tensor="routed_expert_weights",
            )
        covered = infer_coverage(experts) if routing.covered is None else routing.covered.bool()
        if covered.shape != experts.shape[:1]:
            raise RoutingReplayError(
                f"covered must be [N={experts.shape[0]}] bool, got {tuple(covered.shape)}",
                tensor="covered",
            )
        num_experts = self.routers[0].num_experts
        bad = covered & (experts.to(torch.long) >= num_experts).flatten(1).any(dim=1)
        if bad.any():
            rows = bad.nonzero()[:, 0].tolist()
            raise RoutingReplayError(
                f"routed_experts rows {rows[:10]} name experts >= {num_experts}; was the routing "
                "recorded with another model?",
                tensor="routed_experts",
                pos=rows[0],
            )
        self._routing, self._covered = routing, covered
        replayed = covered.sum()
        return {"rows_replayed": replayed, "rows_fallen_back": covered.numel() - replayed}

    def clear(self) -> None:
        self._routing = self._covered = None

    @contextmanager
    def replaying(self, routing: Routing) -> Iterator[dict[str, torch.Tensor]]:
        """Context form of :meth:`set` / :meth:`clear`; yields the row counters."""
        metrics = self.set(routing)
        try:
            yield metrics
        finally:
            self.clear()

    @contextmanager
    def recording(self) -> Iterator[list[Routing]]:
        """Record the model's own routing; the yielded list holds one :class:`Routing` afterwards
        (ids ``[N, L, K]`` int64, weights ``[N, L, K]`` fp32, all rows covered)."""
        out: list[Routing] = []
        self._record = []
        try:
            yield out
        finally:
            record, self._record = self._record, None
            if len(record) == len(self.routers):
                ids = torch.stack([i for i, _ in record], dim=1)
                out.append(
                    Routing(
                        experts=ids,
                        weights=torch.stack([w for _, w in record], dim=1),
                        covered=torch.ones(ids.shape[0], dtype=torch.bool),
                    )
                )

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(router: nn.Module, args: object, output: tuple) -> tuple | None:
            logits, scores, indices = output
            if self._routing is not None:
                assert self._covered is not None
                experts = self._routing.experts[:, layer].to(device=indices.device)
                if experts.shape[0] != indices.shape[0]:
                    raise RoutingReplayError(
                        f"routing has {experts.shape[0]} rows, the router sees "
                        f"{indices.shape[0]} tokens; pass the routing of this forward's tokens",
                        tensor="routed_experts",
                        layer=layer,
                    )
                weights = self._routing.weights
                scores, indices = replayed_router_output(
                    logits,
                    scores,
                    indices,
                    experts=experts.to(torch.long),
                    covered=self._covered.to(indices.device),
                    weights=weights[:, layer] if self.replay_weights else None,
                    renormalize=getattr(router, "norm_topk_prob", True),
                )
                output = (logits, scores, indices)
            if self._record is not None:
                self._record.append((indices.detach(), scores.detach().float()))
            return output

        return hook
