"""Prompts, which step takes them, and advantages within a group (pure).

A producer samples ``group_size`` rollouts of every prompt; step ``k`` takes the prompts
``k * per_step .. (k + 1) * per_step - 1`` of its list (:func:`step_prompts`), so a restarted
producer given the same list assigns every prompt to the step it had (the cursor records the
assignment and refuses another). A rollout's advantage is its reward normalised within its
prompt's group (:func:`group_advantages`, GRPO's): ``(r - mean(r)) / (std(r) + eps)``, the
standard deviation over the group (``ddof=0``); a group whose rewards are all equal gets 0.

Example: rewards ``[1, 0, 0, 1]`` -> mean 0.5, std 0.5 -> advantages ``[1, -1, -1, 1]`` (to
``eps``); rewards ``[2, 2]`` -> ``[0, 0]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rollfeed.orchestrator.errors import OrchestratorError

EPS = 1e-6


@dataclass(frozen=True, kw_only=True, slots=True)
class Prompt:
    """A prompt: its ``id`` (unique in a run; it names the rollouts, ``"<id>/<sample>"``) and
    its ``token_ids``."""

    id: str
    token_ids: tuple[int, ...]


def check_prompts(prompts: Sequence[Prompt]) -> None:
    """Every prompt has an id of its own and at least one token."""
    seen: set[str] = set()
    for i, p in enumerate(prompts):
        if not p.id or "/" in p.id:
            raise OrchestratorError(f"prompt {i}: an id is a non-empty string without '/'")
        if p.id in seen:
            raise OrchestratorError(f"prompt {i}: id {p.id!r} is used twice", prompt=p.id)
        if not p.token_ids:
            raise OrchestratorError(f"prompt {i} has no token", prompt=p.id)
        seen.add(p.id)


def step_count(prompts: int, per_step: int) -> int:
    """The steps a list of ``prompts`` fills: whole steps only (the rest is left for the next
    list)."""
    if per_step < 1:
        raise OrchestratorError(f"prompts_per_step must be >= 1, got {per_step}")
    return prompts // per_step


def step_prompts(prompts: Sequence[Prompt], step: int, per_step: int) -> list[Prompt]:
    """The prompts step ``step`` takes."""
    return list(prompts[step * per_step : (step + 1) * per_step])


def group_advantages(rewards: Sequence[float], *, eps: float = EPS) -> np.ndarray:
    """``[G]`` float64 advantages of one group's ``[G]`` rewards (see the module doc)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0 or not np.isfinite(r).all():
        raise OrchestratorError(f"a group's rewards must be finite numbers, got {list(rewards)}")
    centered = r - r.mean()
    std = r.std()
    return centered / (std + eps) if std > 0 else np.zeros_like(r)
