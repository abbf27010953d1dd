"""Router replay for HF MoE models: run the experts the sampler ran (rollout routing replay, R3).

The sampler records, per token and MoE layer, the ``top_k`` expert ids it routed to
(``routed_experts [N, L, K]``, small ints). In the trainer forward each router's own choice is
replaced by the recorded ids; the mixing weights are recomputed from the router's own dense scores
over those ids by the family's formula (:mod:`rollfeed.models.router_families`), so gradients reach
the router for every replayed id. Optionally the recorded weights (``routed_expert_weights
[N, L, K]``) replace the mixing weights too ("total router recall"); then no mixing gradient
reaches the router. Idea: Ma et al., "Stabilizing MoE RL by aligning training and inference
routers" (2025, arXiv:2510.11370).

Which rows carry recorded routing is data: ``Routing.covered [N]``, the field's coverage from the
read (``TensorMicroBatch.coverage``). Rows without it (positions the sampler never forwarded,
padding, a dummy micro batch) keep the model's own routing and are counted; this holds for top-1
routers too, where a fill row could not be told from expert 0.

Example, softmax family, K = 2, one layer, router probabilities of a token ``[.1, .2, .3, .4]``::

    own routing        ids [3, 2]  weights [.4/.7, .3/.7]   (norm_topk_prob)
    replayed ids [0, 3]            weights [.1/.5, .4/.5]   (router's own probs over those ids)
    replayed with recorded weights [0.25, 0.75]             (taken as given)

The hook sits on the router module and rewrites its output, so the MoE block and its expert
kernels run unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from rollfeed.models.errors import RoutingReplayError
from rollfeed.models.router_checks import check_routing, drift_guard
from rollfeed.models.router_families import RouterFamily, describe_families, family_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Routing:
    """Recorded routing of one forward's tokens (the ``inputs`` window of a micro batch).

    ``experts [N, L, K]`` uint8/uint16/int ids; ``covered [N]`` bool, True on rows that carry
    recorded routing (the rest keep the model's own); ``weights [N, L, K]`` float or None.
    """

    experts: torch.Tensor
    covered: torch.Tensor
    weights: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterSite:
    """One MoE router of a model: its module path, the module and its family."""

    path: str
    router: nn.Module
    family: RouterFamily


def _looks_like_router(name: str, module: nn.Module, parents: dict[str, nn.Module]) -> bool:
    parent, _, attr = name.rpartition(".")
    block = parents.get(parent)
    return "Router" in type(module).__name__ or (
        attr == "gate" and block is not None and hasattr(block, "experts")
    )


def find_routers(model: nn.Module) -> list[RouterSite]:
    """The model's MoE routers in forward order (layer ``l`` of ``routed_experts`` is the l-th):
    every module whose class name contains ``Router`` or that is the ``gate`` of a block with
    ``experts``. One not in the family table raises, listing the table."""
    modules = dict(model.named_modules())
    sites, unknown = [], {}
    for name, module in modules.items():
        if not _looks_like_router(name, module, modules):
            continue
        family = family_of(module)
        if family is None:
            unknown.setdefault(type(module).__name__, name)
        else:
            sites.append(RouterSite(path=name, router=module, family=family))
    if unknown:
        listed = ", ".join(f"{cls} ({path})" for cls, path in unknown.items())
        raise RoutingReplayError(
            f"router replay does not know the router family of {listed}; known families: "
            f"{describe_families()}. Add a RouterFamily entry for it",
            layer=next(iter(unknown.values())),
        )
    return sites


class RouterReplay:
    """Hooks on every router of ``model`` that replay a :class:`Routing` while one is set.

    ``replay_weights=True`` takes ``Routing.weights`` as the mixing weights (it must then be given).
    ``drift_ratio``: the optional drift guard (:func:`rollfeed.models.router_checks.drift_guard`),
    off when None; its replaced slots are counted in ``slots_replaced``, and their rows take the
    family's weights even with ``replay_weights``. With activation checkpointing, keep the routing
    set until backward has run (:meth:`set` / :meth:`clear`): the recomputed forward reads it
    again (and does not count again).
    """

    def __init__(
        self, model: nn.Module, *, replay_weights: bool = False, drift_ratio: float | None = None
    ) -> None:
        self.sites = find_routers(model)
        if not self.sites:
            raise RoutingReplayError(
                f"{type(model).__name__} has no MoE router to replay (known families: "
                f"{describe_families()})"
            )
        if drift_ratio is not None and not drift_ratio >= 0:
            raise RoutingReplayError(
                f"drift_ratio must be >= 0 (a fraction of the weakest own top-k probability) or "
                f"None to switch the guard off, got {drift_ratio}"
            )
        top_ks = {int(site.router.top_k) for site in self.sites}
        experts = {int(site.router.num_experts) for site in self.sites}
        if len(top_ks) != 1 or len(experts) != 1:
            raise RoutingReplayError(
                f"routers disagree on top_k {sorted(top_ks)} or expert count {sorted(experts)}; "
                "replay needs one [N, L, K] routing shape"
            )
        self.top_k, self.num_experts = top_ks.pop(), experts.pop()
        self.replay_weights = replay_weights
        self.drift_ratio = drift_ratio
        self._routing: Routing | None = None
        self._metrics: dict[str, torch.Tensor] = {}
        self._counted: set[int] = set()
        self._record: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._handles = [
            site.router.register_forward_hook(self._hook(layer, site))
            for layer, site in enumerate(self.sites)
        ]

    @property
    def layers(self) -> int:
        return len(self.sites)

    def set(self, routing: Routing) -> dict[str, torch.Tensor]:
        """Replay ``routing`` in every forward until :meth:`clear` (checked first:
        :func:`rollfeed.models.router_checks.check_routing`).

        Returns the counters ``rows_replayed``, ``rows_fallen_back`` (rows without recorded
        routing) and ``slots_replaced`` (drift guard; filled in by the forward), 0-d int64
        tensors (the convention of :mod:`rollfeed.models`).
        """
        experts, covered = routing.experts, routing.covered
        check_routing(
            experts,
            covered,
            layers=self.layers,
            top_k=self.top_k,
            num_experts=self.num_experts,
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
        self._routing, self._counted = routing, set()
        replayed = covered.sum()
        self._metrics = {
            "rows_replayed": replayed,
            "rows_fallen_back": covered.numel() - replayed,
            "slots_replaced": torch.zeros((), dtype=torch.int64, device=covered.device),
        }
        return self._metrics

    def clear(self) -> None:
        self._routing = None

    @contextmanager
    def replaying(self, routing: Routing) -> Iterator[dict[str, torch.Tensor]]:
        """Context form of :meth:`set` / :meth:`clear`; yields the counters."""
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
            if len(record) == self.layers:
                ids = torch.stack([i for i, _ in record], dim=1)
                out.append(
                    Routing(
                        experts=ids,
                        weights=torch.stack([w for _, w in record], dim=1),
                        covered=torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device),
                    )
                )

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _replay(self, layer: int, site: RouterSite, output: tuple) -> tuple:
        routing = self._routing
        assert routing is not None
        family, router = site.family, site.router
        logits, own_weights, own_ids = family.unpack(router, output)
        ids = routing.experts[:, layer].to(device=own_ids.device, dtype=torch.long)
        if ids.shape[0] != own_ids.shape[0]:
            raise RoutingReplayError(
                f"routing has {ids.shape[0]} rows, the router sees {own_ids.shape[0]} tokens; "
                "pass the routing of this forward's tokens",
                tensor="routed_experts",
                layer=layer,
            )
        covered = routing.covered.to(own_ids.device)[:, None]
        recorded = None
        if self.replay_weights:
            assert routing.weights is not None
            recorded = routing.weights[:, layer].to(own_ids.device, torch.float32)
        if self.drift_ratio is not None:
            ids, replaced = drift_guard(family.selection(logits), own_ids, ids, self.drift_ratio)
            replaced &= covered
            if layer not in self._counted:
                self._metrics["slots_replaced"] += replaced.sum()
            if recorded is not None:  # a replaced slot has no recorded weight: the family's
                recorded = torch.where(
                    replaced.any(dim=1, keepdim=True),
                    family.weights(router, logits, ids).float(),
                    recorded,
                )
        self._counted.add(layer)
        ids = torch.where(covered, ids, own_ids)
        if family.dense:
            dense = family.dense_scores(logits, ids, recorded)
            return family.pack(output, logits, torch.where(covered, dense, output[0]), ids)
        mixed = recorded if recorded is not None else family.weights(router, logits, ids)
        weights = torch.where(covered, mixed, own_weights.to(mixed.dtype)).to(own_weights.dtype)
        return family.pack(output, logits, weights, ids)

    def _hook(self, layer: int, site: RouterSite):
        def hook(router: nn.Module, args: object, output: tuple) -> tuple:
            if self._routing is not None:
                output = self._replay(layer, site, output)
            if self._record is not None:
                _, weights, ids = site.family.unpack(router, output)
                self._record.append((ids.detach(), weights.detach().float()))
            return output

        return hook
