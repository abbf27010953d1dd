"""Router families: how each MoE router family chooses its experts and mixes their outputs.

Replay overrides the *choice* (the expert ids); the mixing weights of the replayed ids are
recomputed from the live router's own dense scores by the family's formula, gathered per id, so
the router gets a gradient for every replayed id. One :class:`RouterFamily` entry per family, in
:data:`ROUTER_FAMILIES`; adding a family is one entry. The formulas, as transformers 5.x computes
them (``l [N, E]`` router logits, ``ids [N, K]``)::

    softmax       w = softmax(l, fp32)[ids] / sum (norm_topk_prob)      Qwen, Mixtral, OLMoE
    softmax_topk  w = softmax(l[ids])  (in the logits' dtype)            gpt-oss
    sigmoid       w = sigmoid(l, fp32)[ids] / (sum + eps) * scaling      DeepSeek-V3, GLM-4.5,
                  (normalised when norm_topk_prob; the choice adds a     dots1, MiniMax-M2
                  correction bias and a group limit, never the weights)
    sigmoid dense scores [N, E] = sigmoid(l[ids] at ids, -inf elsewhere)  Llama-4 (top-1)

Example: softmax family, norm_topk_prob, probabilities of one token ``[.1, .2, .3, .4]``,
replayed ids ``[0, 3]`` -> weights ``[.1/.5, .4/.5] = [.2, .8]``; a sigmoid family with scaling
2.5 and sigmoid scores ``[.5, .6, .9, .8]``, ids ``[2, 0]``, normalised -> ``[.9, .5] / 1.4 * 2.5``.

Which families are not here and why: hash routers (DeepSeek-V4's ``HashRouter``: the choice is a
table lookup of the token id, nothing to replay), routers whose weights are not a function of the
router's own scores at the chosen ids (sparsemixer in Phi-MoE: the weights depend on the sampled
order of the choice) and blocks where the choice is made outside a router module (DBRX's
``route_tokens_to_experts``). A module that looks like a router and is not listed raises
:class:`~rollfeed.models.RoutingReplayError` listing this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

ScoreFunction = Literal["softmax", "softmax_topk", "sigmoid"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterFamily:
    """How one family's router chooses and mixes (see the module doc for the formulas).

    ``routers``: router class names. ``attr``: the router's attribute name on its MoE block.
    ``score``: the score function. ``normalize``: a router attribute naming whether the chosen
    weights are normalised to sum 1 (read per router; a router without it normalises, as
    Qwen3-VL-MoE's and Qwen3.5-MoE's always do), or a constant. ``norm_eps``: added to
    the normalising sum. ``scaling``: router attribute of a factor the weights are multiplied
    by, or None. ``choice_bias``: where the correction bias that steers only the choice lives
    (``"router.<name>"`` / ``"block.<name>"``), or None. ``groups``: the choice is limited to
    ``topk_group`` of ``num_group`` expert groups. ``dense``: the router returns
    ``(dense scores [N, E], logits)`` (Llama-4) instead of ``(logits, weights [N, K], ids)``.
    """

    name: str
    routers: tuple[str, ...]
    attr: str = "gate"
    score: ScoreFunction
    normalize: str | bool = "norm_topk_prob"
    norm_eps: float = 0.0
    scaling: str | None = None
    choice_bias: str | None = None
    groups: bool = False
    dense: bool = False

    def normalized(self, router: nn.Module) -> bool:
        if isinstance(self.normalize, bool):
            return self.normalize
        return bool(getattr(router, self.normalize, True))

    def selection(self, logits: torch.Tensor) -> torch.Tensor:
        """``[N, E]`` fp32: the probability the choice ranks by, without any correction bias
        (softmax over all experts for softmax and softmax_topk families, sigmoid otherwise)."""
        if self.score == "sigmoid":
            return logits.float().sigmoid()
        return torch.softmax(logits, dim=-1, dtype=torch.float32)

    def weights(self, router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Mixing weights ``[N, K]`` of ``ids [N, K]`` from the live ``logits [N, E]``, in the
        dtype the family computes them in (the caller casts to the router's output dtype)."""
        if self.score == "softmax_topk":
            return torch.softmax(logits.gather(1, ids), dim=1, dtype=logits.dtype)
        chosen = self.selection(logits).gather(1, ids)
        if self.normalized(router):
            chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + self.norm_eps)
        if self.scaling is not None:
            chosen = chosen * getattr(router, self.scaling)
        return chosen

    def dense_scores(
        self, logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """``[N, E]`` dense scores of a dense family: the recorded ``weights`` at ``ids`` (0
        elsewhere), or the family's sigmoid of the logits at ``ids``, as the router computes it."""
        if weights is not None:
            return torch.zeros_like(logits).scatter(1, ids, weights.to(logits.dtype))
        chosen = torch.full_like(logits, float("-inf")).scatter(1, ids, logits.gather(1, ids))
        return chosen.float().sigmoid().to(logits.dtype)

    def unpack(self, router: nn.Module, output: tuple) -> tuple[torch.Tensor, ...]:
        """The router's output -> ``(logits [N, E], weights [N, K], ids [N, K])``."""
        if self.dense:
            scores, logits = output
            ids = logits.topk(router.top_k, dim=1).indices
            return logits, scores.gather(1, ids), ids
        return tuple(output)

    def pack(
        self, output: tuple, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple:
        """The router's output with the replayed ``weights`` / ``ids`` (dense families: the
        dense scores as ``weights``)."""
        if self.dense:
            return (weights, output[1])
        return (output[0], weights, ids)


_SOFTMAX_ROUTERS = (
    "Qwen2MoeTopKRouter",
    "Qwen3MoeTopKRouter",
    "Qwen3VLMoeTextTopKRouter",
    "Qwen3NextTopKRouter",
    "Qwen3_5MoeTopKRouter",
    "OlmoeTopKRouter",
)

ROUTER_FAMILIES: tuple[RouterFamily, ...] = (
    RouterFamily(name="qwen-moe/olmoe", routers=_SOFTMAX_ROUTERS, score="softmax"),
    RouterFamily(name="mixtral", routers=("MixtralTopKRouter",), score="softmax", normalize=True),
    RouterFamily(
        name="gpt-oss",
        routers=("GptOssTopKRouter",),
        attr="router",
        score="softmax_topk",
        normalize=False,  # a softmax over the k sums to 1 by itself
    ),
    RouterFamily(
        name="deepseek-v3/glm-4.5/dots1",
        routers=("DeepseekV3TopkRouter", "Glm4MoeTopkRouter", "Dots1TopkRouter"),
        score="sigmoid",
        norm_eps=1e-20,
        scaling="routed_scaling_factor",
        choice_bias="router.e_score_correction_bias",
        groups=True,
    ),
    RouterFamily(
        name="minimax-m2",
        routers=("MiniMaxM2TopKRouter",),
        score="sigmoid",
        normalize=True,
        choice_bias="block.e_score_correction_bias",
    ),
    RouterFamily(
        name="llama4",
        routers=("Llama4Router",),
        attr="router",
        score="sigmoid",
        normalize=False,
        dense=True,
    ),
)


def family_of(router: nn.Module) -> RouterFamily | None:
    """The table entry of ``router``'s class, or None."""
    name = type(router).__name__
    return next((f for f in ROUTER_FAMILIES if name in f.routers), None)


def describe(family: RouterFamily) -> str:
    """One family as a line of text, e.g. ``minimax-m2 (block.gate, sigmoid, normalised, choice
    bias block.e_score_correction_bias: MiniMaxM2TopKRouter)``."""
    rules = [f"block.{family.attr}", family.score + (" dense" if family.dense else "")]
    if family.normalize is True:
        rules.append("normalised")
    elif family.normalize:
        rules.append(f"normalised if {family.normalize}")
    if family.scaling:
        rules.append(f"scaled by {family.scaling}")
    if family.choice_bias:
        rules.append(f"choice bias {family.choice_bias}")
    if family.groups:
        rules.append("group-limited (num_group, topk_group)")
    return f"{family.name} ({', '.join(rules)}: {', '.join(family.routers)})"


def describe_families() -> str:
    """The whole table as text, for errors."""
    return "; ".join(describe(f) for f in ROUTER_FAMILIES)
