"""Samples with the loss masks real steps have (none, a completion, several turns, all) and the
edge cases of the label shift and of truncation (a loss token at position 0 only, loss tokens only
at the end), for the step-count tests."""

from __future__ import annotations

import numpy as np

from rollfeed.collate import Sample

MASKS = ("none", "first", "completion", "turns", "all", "tail")


def loss_mask(rng, kind: str, T: int) -> np.ndarray:
    """Loss masks of the shapes real steps have, and the edge cases of the label shift."""
    mask = np.zeros(T, bool)
    if kind == "first":  # token 0 alone: never a label, so no loss token at all
        mask[0] = True
    elif kind == "completion":
        mask[int(rng.integers(0, T)) :] = True
    elif kind == "turns":  # several runs (multi-turn: tool outputs masked out)
        mask = rng.random(T) < 0.5
    elif kind == "all":
        mask[:] = True
    elif kind == "tail":  # loss tokens only near the end: often all cut by truncation
        mask[max(T - 3, 0) :] = True
    return mask


def samples_for(seed: int, n: int, seq_len: int, longest: int | None = None) -> list[Sample]:
    """``n`` samples of 1 to ``longest`` tokens (default ``2 * seq_len``: about half longer)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        T = int(rng.integers(1, (longest or 2 * seq_len) + 1))
        out.append(
            Sample(
                rng.integers(0, 100, T),
                loss_mask=loss_mask(rng, MASKS[int(rng.integers(0, len(MASKS)))], T),
                advantages=rng.standard_normal(T).astype(np.float32),
                inference_logprobs=np.zeros(T, np.float32),
                uid=f"s{i}",
            )
        )
    return out
