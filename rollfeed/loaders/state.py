"""Resumable sampler state: a few integers, the plan's options and the identity of the samples
counted, with a version; never pickled buffers.

The plan of a step is recomputed on resume (it is a pure function of the step's lengths, the
seed, the world shape and the plan's options), so the state says where in it to continue, what it
was planned under and which samples it counted in::

    {"version": 3, "step": 7, "micro_batches": 3, "seed": 0, "dp_size": 2, "cp_size": 2,
     "plan": {"seq_len": 64, "cp_layout": "zigzag", "pad_to_multiple_of": None,
              "overlong": "truncate", "quadratic_cost": 2.0345052083333332e-05,
              "shuffle": False, "drop_staleness": -1},
     "data": {"samples": 13, "tokens": 480, "digest": "5c1d0e...(32 hex digits)"}}
    # step 7, its first 3 micro batches consumed, of the samples "data" names
    # (:mod:`~rollfeed.loaders.step_identity`); a finished step is saved as (step + 1, 0), and a
    # state with no micro batch of its step consumed has "data": {"samples": 0, "tokens": 0,
    # "digest": ""} (always a dict of these keys: one structure, as a DCP checkpoint needs)

Checks, each failure a :class:`LoaderStateError` naming the step and what differs:

- loading (:meth:`SamplerState.from_dict`): exactly these keys; ``step`` an int in
  ``[0, 2**31)`` (a dataset index is ``step * 2**32 + sample`` in int64), ``micro_batches`` and
  ``seed`` ints in ``[0, 2**62)``, ``dp_size`` and ``cp_size`` ints >= 1 (no bools, floats or
  strings); ``data`` names samples exactly when ``micro_batches`` > 0;
- loading (:func:`resume_point`): the seed is this sampler's (another seed is always refused: it is
  the run's order, not a shape to adapt to); a state saved under another world shape
  (``dp_size``, ``cp_size``) or other plan options (``plan``, the plan fingerprint
  :mod:`~rollfeed.loaders.plan_fingerprint`) is refused naming every difference
  (``"dp_size: 2 -> 1"``, ``"seq_len: 64 -> 128"``);
- starting the pass of the interrupted step (:func:`continue_at`, once its step file is there;
  :func:`step_gone` when it has none but a later step has):
  the step holds the samples ``data`` names, and ``micro_batches`` is fewer than this rank's
  planned micro batches of it. A count at or past the plan is always refused (no state this loader
  saves has one), never a pass of nothing.

Where the step would be planned otherwise -- another world shape or plan options, or other
samples (its step file rewritten) -- a policy may say what to do instead of the error
(``on_reshard``): ``"restart_step"`` replans the interrupted step and starts it over (its consumed
micro batches are repeated), ``"next_step"`` skips the rest of it (those samples are not seen).
Either way the choice is explicit and logged as a warning.

A state of version 2 (the same without ``data``) is migrated: at a step boundary
(``micro_batches`` 0) as it is; mid-step it cannot say which samples it counted, so it is taken as
one saved under another plan: refused under ``on_reshard="error"``, naming the two policies as the
way out, else restarted or skipped as the policy says.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollfeed.loaders.config import Reshard
from rollfeed.loaders.errors import LoaderStateError
from rollfeed.loaders.plan_fingerprint import ADDED, FINGERPRINT_KEYS, fingerprint_differences
from rollfeed.loaders.step_files import MAX_STEP
from rollfeed.loaders.step_identity import NO_SAMPLES, StepIdentity

logger = logging.getLogger(__name__)
STATE_VERSION = 3
MIGRATED = (2,)  # versions without "data"
_COUNTS = ("step", "micro_batches", "seed", "dp_size", "cp_size")
_LOW = {"step": 0, "micro_batches": 0, "seed": 0, "dp_size": 1, "cp_size": 1}
_WAY_OUT = (
    "pass LoaderConfig(on_reshard='restart_step') (train the step again from its start) or "
    "'next_step' (skip its rest)"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplerState:
    """Where a sampler stands, what it planned under and which samples it counted in; see the
    module doc. ``data`` is ``None`` when ``micro_batches`` is 0 (and for a migrated version 2
    state, which cannot say); :meth:`to_dict` writes it as ``NO_SAMPLES`` then."""

    step: int
    micro_batches: int
    seed: int
    dp_size: int
    cp_size: int
    plan: Mapping[str, Any] = field(hash=False)
    data: StepIdentity | None = None
    version: int = STATE_VERSION

    def to_dict(self) -> dict[str, Any]:
        counts = {k: getattr(self, k) for k in _COUNTS}
        data = dict(NO_SAMPLES) if self.data is None else self.data.to_dict()
        return {"version": STATE_VERSION, **counts, "plan": dict(self.plan), "data": data}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> SamplerState:
        version = state.get("version") if isinstance(state, Mapping) else None
        migrated = type(version) is int and version in MIGRATED
        want = {"version", *_COUNTS, "plan"} | (set() if migrated else {"data"})
        if not isinstance(state, Mapping) or set(state) != want:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise LoaderStateError(
                f"sampler state has keys {keys}, expected {sorted(want)}; pass the dict "
                "that state_dict() returned"
            )
        if not migrated and (type(version) is not int or version != STATE_VERSION):
            raise LoaderStateError(
                f"sampler state version {version!r} != supported {STATE_VERSION} (or "
                f"{', '.join(map(str, MIGRATED))}, migrated); a state of another rollfeed "
                "version does not say which plan it counts in"
            )
        values = {k: state[k] for k in _COUNTS}
        bad = [
            f"{k}={v!r}"
            for k, v in values.items()
            if type(v) is not int or not _LOW[k] <= v < (MAX_STEP + 1 if k == "step" else 1 << 62)
        ]
        if bad:
            raise LoaderStateError(
                f"sampler state values must be ints: step in [0, 2**31), micro_batches and seed "
                f"in [0, 2**62), dp_size and cp_size >= 1; got {', '.join(bad)}",
                step=values["step"] if type(values["step"]) is int else None,
            )
        plan = state["plan"]
        if isinstance(plan, Mapping) and set(plan) == set(FINGERPRINT_KEYS) - set(ADDED):
            plan = {**plan, **ADDED}
        if not isinstance(plan, Mapping) or set(plan) != set(FINGERPRINT_KEYS):
            raise LoaderStateError(
                f"sampler state plan must map {sorted(FINGERPRINT_KEYS)}, got {plan!r}; pass the "
                "dict that state_dict() returned"
            )
        data = None
        if not migrated:
            data = StepIdentity.from_dict(state["data"])
            if (data is None) != (values["micro_batches"] == 0):
                raise LoaderStateError(
                    "sampler state data must name the samples of the step exactly when some of "
                    f"its micro batches were consumed (micro_batches={values['micro_batches']}, "
                    f"data={state['data']!r}); pass the dict that state_dict() returned",
                    step=values["step"],
                )
        return cls(**values, plan=dict(plan), data=data, version=version)


def resume_point(
    saved: SamplerState,
    *,
    seed: int,
    dp_size: int,
    cp_size: int,
    plan: Mapping[str, Any],
    on_reshard: Reshard,
) -> tuple[int, int, StepIdentity | None]:
    """``(step, micro_batches, data)`` to continue from under this sampler's seed, world shape
    and plan fingerprint ``plan`` (``on_reshard`` checked by the config); ``data`` is held to the
    step's samples by :func:`continue_at` when the pass starts."""
    if saved.seed != seed:
        raise LoaderStateError(
            f"state was saved with seed={saved.seed}, this sampler has seed={seed}; build the "
            "sampler with the saved seed",
            step=saved.step,
        )
    sizes = (("dp_size", saved.dp_size, dp_size), ("cp_size", saved.cp_size, cp_size))
    shape = [f"{name}: {was} -> {now}" for name, was, now in sizes if was != now]
    changes = shape + fingerprint_differences(saved.plan, plan)
    if saved.micro_batches and saved.data is None:
        changes.append(f"version {saved.version}: no record of the step's samples counted")
    if not changes:
        return saved.step, saved.micro_batches, saved.data
    what = "; ".join(changes)
    if on_reshard == "error":
        raise LoaderStateError(
            f"state was saved under another world shape or plan ({what}), so its count of "
            f"micro batches consumed is not one of this loader's plan of step {saved.step}; "
            f"build the loader with the saved options, or {_WAY_OUT}",
            step=saved.step,
        )
    if saved.micro_batches == 0 or on_reshard == "restart_step":
        logger.warning("resharding (%s): restarting step %d", what, saved.step)
        return saved.step, 0, None
    logger.warning("resharding (%s): skipping the rest of step %d", what, saved.step)
    return saved.step + 1, 0, None


def continue_at(
    step: int,
    consumed: int,
    counted: StepIdentity | None,
    now: StepIdentity,
    planned: int,
    *,
    on_reshard: Reshard,
    log: bool = True,
) -> int | None:
    """The micro batch a pass over ``step`` starts at, ``consumed`` of them taken before, which
    were counted in the samples ``counted`` (the step holds ``now``; this rank's plan of it has
    ``planned`` micro batches): ``consumed`` when that holds exactly; under a policy, ``0``
    (``"restart_step"``) or ``None`` (``"next_step"``: skip the step) when the samples differ;
    :class:`LoaderStateError` otherwise (see the module doc). ``log``: warn of a policy's
    choice (not when only asked for the pass's length)."""
    if consumed == 0:
        return 0
    assert counted is not None, "a mid-step count always carries the samples it counted"
    if counted != now:
        what = f"{counted} -> {now}"
        if on_reshard == "error":
            raise LoaderStateError(
                f"state was saved after {consumed} micro batches of step {step} when the step "
                f"held other samples ({what}): its step file was rewritten after the state was "
                "saved, so that count is not one of this plan's (continuing would skip samples "
                f"or train on none); put the step file back as it was, or {_WAY_OUT}",
                step=step,
            )
        restart = on_reshard == "restart_step"
        if log:
            choice = "restarting it" if restart else "skipping its rest"
            logger.warning(
                "step %d holds other samples than the state counted in (%s): %s (on_reshard=%r)",
                step,
                what,
                choice,
                on_reshard,
            )
        return 0 if restart else None
    if consumed >= planned:
        raise LoaderStateError(
            f"state says {consumed} micro batches of step {step} were consumed, but this rank's "
            f"plan of the step has {planned} (a finished step is saved as (step + 1, 0)): the "
            "state was not saved by this loader for these samples; pass the dict that "
            "state_dict() returned",
            step=step,
        )
    return consumed


def step_gone(step: int, consumed: int, found: int, *, on_reshard: Reshard, log: bool) -> None:
    """A state counted ``consumed`` micro batches of ``step``, whose step file is gone (the next
    one present is ``found``): its rest cannot be trained. :class:`LoaderStateError` under
    ``on_reshard="error"``; under a policy the pass goes on at ``found`` (logged)."""
    what = (
        f"state was saved after {consumed} micro batches of step {step}, but step {step} has no "
        f"step file now (the next one is step {found})"
    )
    if on_reshard == "error":
        raise LoaderStateError(
            f"{what}: its rest cannot be trained; put the step file back, or {_WAY_OUT}",
            step=step,
        )
    if log:
        logger.warning("%s: going on at step %d (on_reshard=%r)", what, found, on_reshard)
