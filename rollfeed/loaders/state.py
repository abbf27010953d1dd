"""Resumable sampler state: a few integers and the plan's options, with a version; never
pickled buffers.

The plan of a step is recomputed on resume (it is a pure function of the step's lengths, the
seed, the world shape and the plan's options), so the state says where in it to continue and
what it was planned under::

    {"version": 2, "step": 7, "micro_batches": 3, "seed": 0, "dp_size": 2, "cp_size": 2,
     "plan": {"seq_len": 64, "cp_layout": "zigzag", "pad_to_multiple_of": None,
              "overlong": "truncate", "quadratic_cost": 2.0345052083333332e-05,
              "shuffle": False}}
    # step 7, its first 3 micro batches consumed; a finished step is saved as (step + 1, 0)

``plan`` is the plan fingerprint (:mod:`~rollfeed.loaders.plan_fingerprint`). A state whose
interrupted step this loader would plan otherwise -- saved under another world shape
(``dp_size``, ``cp_size``) or other plan options (``plan``) -- is refused, naming every
difference (``"dp_size: 2 -> 1"``, ``"seq_len: 64 -> 128"``), unless a policy says what to do
(``on_reshard``): ``"restart_step"`` replans the interrupted step and starts it over (its consumed
micro batches are repeated), ``"next_step"`` skips the rest of it (those samples are not seen).
Either way the choice is explicit and logged. Another seed is always refused (it is the run's
order, not a shape to adapt to).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollfeed.loaders.config import Reshard
from rollfeed.loaders.errors import LoaderStateError
from rollfeed.loaders.plan_fingerprint import FINGERPRINT_KEYS, fingerprint_differences

logger = logging.getLogger(__name__)
STATE_VERSION = 2
_COUNTS = ("step", "micro_batches", "seed", "dp_size", "cp_size")


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplerState:
    """Where a sampler stands and what it planned under; see the module doc."""

    step: int
    micro_batches: int
    seed: int
    dp_size: int
    cp_size: int
    plan: Mapping[str, Any] = field(hash=False)
    version: int = STATE_VERSION

    def to_dict(self) -> dict[str, Any]:
        counts = {k: getattr(self, k) for k in ("version", *_COUNTS)}
        return counts | {"plan": dict(self.plan)}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> SamplerState:
        want = {"version", *_COUNTS, "plan"}
        if not isinstance(state, Mapping) or set(state) != want:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise LoaderStateError(
                f"sampler state has keys {keys}, expected {sorted(want)}; pass the dict "
                "that state_dict() returned"
            )
        if state["version"] != STATE_VERSION:
            raise LoaderStateError(
                f"sampler state version {state['version']} != supported {STATE_VERSION}; a "
                "state of another rollfeed version does not say which plan it counts in"
            )
        values = {k: state[k] for k in _COUNTS}
        if not all(type(v) is int and v >= 0 for v in values.values()):
            raise LoaderStateError(f"sampler state values must be ints >= 0, got {values}")
        plan = state["plan"]
        if not isinstance(plan, Mapping) or set(plan) != set(FINGERPRINT_KEYS):
            raise LoaderStateError(
                f"sampler state plan must map {sorted(FINGERPRINT_KEYS)}, got {plan!r}; pass the "
                "dict that state_dict() returned"
            )
        return cls(**values, plan=dict(plan))


def resume_point(
    saved: SamplerState,
    *,
    seed: int,
    dp_size: int,
    cp_size: int,
    plan: Mapping[str, Any],
    on_reshard: Reshard,
) -> tuple[int, int]:
    """``(step, micro_batches)`` to continue from under this sampler's seed, world shape and plan
    fingerprint ``plan`` (``on_reshard`` checked by the config)."""
    if saved.seed != seed:
        raise LoaderStateError(
            f"state was saved with seed={saved.seed}, this sampler has seed={seed}; build the "
            "sampler with the saved seed",
            step=saved.step,
        )
    sizes = (("dp_size", saved.dp_size, dp_size), ("cp_size", saved.cp_size, cp_size))
    shape = [f"{name}: {was} -> {now}" for name, was, now in sizes if was != now]
    changes = shape + fingerprint_differences(saved.plan, plan)
    if not changes:
        return saved.step, saved.micro_batches
    what = "; ".join(changes)
    if on_reshard == "error":
        raise LoaderStateError(
            f"state was saved under another world shape or plan ({what}), so its count of "
            f"micro batches consumed is not one of this loader's plan of step {saved.step}; "
            "build the loader with the saved options, or pass LoaderConfig(on_reshard="
            "'restart_step') (repeat the interrupted step) or 'next_step' (skip its rest)",
            step=saved.step,
        )
    if saved.micro_batches == 0 or on_reshard == "restart_step":
        logger.warning("resharding (%s): restarting step %d", what, saved.step)
        return saved.step, 0
    logger.warning("resharding (%s): skipping the rest of step %d", what, saved.step)
    return saved.step + 1, 0
