"""Checks of recorded routing against the model, and the optional drift guard.

:func:`check_routing` refuses, with :class:`~rollfeed.models.RoutingReplayError` naming the layer,
the row and the value, routing that cannot be this model's: another number of layers or of slots
(top-k) than the model's routers, expert ids outside ``[0, E)``, or an id repeated in one row of a
top-k > 1 layer. Only covered rows are checked: fill rows are never replayed.

:func:`drift_guard` keeps a replayed expert only when the trainer's own selection probability for
it is at least ``ratio`` times the trainer's weakest top-k probability; a rejected slot takes the
trainer's own next best expert that the row does not already hold. The candidates are the trainer's
own top-k, which its router chose within its group limit, so the refill never enters a group the
trainer's router masked. Example, ratio 0.5, trainer probabilities ``[.05, .1, .35, .5]``, own
top-2 ``[3, 2]`` (weakest .35), replayed ``[0, 3]``: expert 0 (.05 < .175) is rejected and replaced
by expert 2 -> ``[2, 3]``, one replaced slot.
"""

from __future__ import annotations

import torch

from rollfeed.models.errors import RoutingReplayError


def _first(bad: torch.Tensor) -> tuple[int, int]:
    """``[N, L]`` bool -> (row, layer) of the first True, row-major."""
    row, layer = (int(v) for v in bad.nonzero()[0])
    return row, layer


def check_routing(
    experts: torch.Tensor,
    covered: torch.Tensor,
    *,
    layers: int,
    top_k: int,
    num_experts: int,
) -> None:
    """``experts [N, L, K]`` ids and ``covered [N]`` bool against the model's ``layers`` routers of
    ``top_k`` slots over ``num_experts`` experts (see module doc)."""
    if experts.ndim != 3 or tuple(experts.shape[1:]) != (layers, top_k):
        raise RoutingReplayError(
            f"routed_experts shape {tuple(experts.shape)} does not match the model's "
            f"[N, {layers} MoE layers, top_k {top_k}]; record the routing with this model",
            tensor="routed_experts",
        )
    if covered.dtype != torch.bool or tuple(covered.shape) != tuple(experts.shape[:1]):
        raise RoutingReplayError(
            f"covered must be a [N={experts.shape[0]}] bool tensor (the field's coverage), got "
            f"{covered.dtype} {tuple(covered.shape)}",
            tensor="covered",
        )
    ids = experts.to(torch.long)
    rows = covered[:, None]
    out_of_range = ((ids < 0) | (ids >= num_experts)).any(dim=-1) & rows
    repeated = torch.zeros_like(out_of_range)
    if top_k > 1:
        repeated = (ids.sort(dim=-1).values.diff(dim=-1) == 0).any(dim=-1) & rows
    # The one host sync of the checks, once per replayed forward: both verdicts read together.
    any_out, any_repeated = torch.stack([out_of_range.any(), repeated.any()]).tolist()
    if any_out:
        row, layer = _first(out_of_range)
        raise RoutingReplayError(
            f"routed_experts[{row}, {layer}] = {ids[row, layer].tolist()} names an expert outside "
            f"[0, {num_experts}); record the routing with this model",
            tensor="routed_experts",
            pos=row,
            layer=layer,
        )
    if any_repeated:
        row, layer = _first(repeated)
        raise RoutingReplayError(
            f"routed_experts[{row}, {layer}] = {ids[row, layer].tolist()} repeats an expert "
            f"in one top-{top_k} row; a recorded row holds distinct ids (is a fill row "
            "marked covered?)",
            tensor="routed_experts",
            pos=row,
            layer=layer,
        )


def drift_guard(
    selection: torch.Tensor,
    own_ids: torch.Tensor,
    ids: torch.Tensor,
    ratio: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``selection [N, E]`` the trainer's selection probabilities, ``own_ids [N, K]`` its own
    top-k, ``ids [N, K]`` the replayed ids -> (guarded ids ``[N, K]``, replaced ``[N, K]`` bool).
    See the module doc for the rule and an example."""
    weakest = selection.gather(1, own_ids).min(dim=1, keepdim=True).values
    keep = selection.gather(1, ids) >= ratio * weakest
    held = torch.zeros_like(selection, dtype=torch.bool).scatter(1, ids, keep)
    # The trainer's own ids, best first, then those the row does not hold yet first.
    ranked = own_ids.gather(1, selection.gather(1, own_ids).argsort(dim=1, descending=True))
    taken = held.gather(1, ranked)
    slot = torch.arange(ranked.shape[1], device=ranked.device)
    free = ranked.gather(1, (taken * ranked.shape[1] + slot).argsort(dim=1))
    nth = ((~keep).cumsum(dim=1) - 1).clamp(min=0)
    return torch.where(keep, ids, free.gather(1, nth)), ~keep
