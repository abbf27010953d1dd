"""Resumable sampler state: a few integers with a version, never pickled buffers.

The plan of a step is recomputed on resume (it is a pure function of the step's lengths, the seed
and the world shape), so the state only says where in it to continue::

    {"version": 1, "step": 7, "micro_batches": 3, "seed": 0, "dp_size": 2, "cp_size": 2}
    # step 7, its first 3 micro batches consumed; a finished step is saved as (step + 1, 0)

Loading a state saved under another world shape is refused unless a policy says what to do
(``on_reshard``): ``"restart_step"`` replans the interrupted step for the new shape and starts it
over (its consumed micro batches are repeated), ``"next_step"`` skips the rest of it (those samples
are not seen). Either way the choice is explicit and logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from rollfeed.loaders.errors import LoaderStateError

logger = logging.getLogger(__name__)
STATE_VERSION = 1
Reshard = Literal["error", "restart_step", "next_step"]
RESHARD: tuple[Reshard, ...] = ("error", "restart_step", "next_step")


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplerState:
    """Where a sampler stands; see the module doc."""

    step: int
    micro_batches: int
    seed: int
    dp_size: int
    cp_size: int
    version: int = STATE_VERSION

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> SamplerState:
        want = {"version", "step", "micro_batches", "seed", "dp_size", "cp_size"}
        if set(state) != want:
            raise LoaderStateError(
                f"sampler state has keys {sorted(state)}, expected {sorted(want)}; pass the dict "
                "that state_dict() returned"
            )
        if state["version"] != STATE_VERSION:
            raise LoaderStateError(
                f"sampler state version {state['version']} != supported {STATE_VERSION}"
            )
        values = {k: state[k] for k in want}
        if not all(isinstance(v, int) and v >= 0 for v in values.values()):
            raise LoaderStateError(f"sampler state values must be ints >= 0, got {values}")
        return cls(**values)


def resume_point(
    saved: SamplerState, *, seed: int, dp_size: int, cp_size: int, on_reshard: Reshard
) -> tuple[int, int]:
    """``(step, micro_batches)`` to continue from under this sampler's seed and world shape
    (``on_reshard`` checked by the sampler)."""
    if saved.seed != seed:
        raise LoaderStateError(
            f"state was saved with seed={saved.seed}, this sampler has seed={seed}; build the "
            "sampler with the saved seed"
        )
    if (saved.dp_size, saved.cp_size) == (dp_size, cp_size):
        return saved.step, saved.micro_batches
    shape = f"dp_size={saved.dp_size}, cp_size={saved.cp_size} -> {dp_size}, {cp_size}"
    if on_reshard == "error":
        raise LoaderStateError(
            f"state was saved under another world shape ({shape}); pass "
            "on_reshard='restart_step' (repeat the interrupted step) or 'next_step' (skip its rest)"
        )
    if saved.micro_batches == 0 or on_reshard == "restart_step":
        logger.warning("resharding %s: restarting step %d", shape, saved.step)
        return saved.step, 0
    logger.warning("resharding %s: skipping the rest of step %d", shape, saved.step)
    return saved.step + 1, 0
