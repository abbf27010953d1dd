"""The plan fingerprint: the options a step's plan depends on, saved with the loader's state.

A state says "step 7, its first 3 micro batches consumed": counts in one plan of step 7. Loaded
into a loader that plans step 7 otherwise (another ``seq_len`` packs other micro batches), the
same counts would skip or repeat samples without a sign. So the state carries the options that
shape a step's plan besides the world shape (which the state holds as ``dp_size`` and
``cp_size``) and the seed (checked on its own), and a load compares them
(:func:`~rollfeed.loaders.state.resume_point`)::

    plan_fingerprint(LoaderConfig(plan=PlanConfig(seq_len=64)))
    -> {"seq_len": 64, "cp_layout": "contiguous", "pad_to_multiple_of": None,
        "overlong": "truncate", "quadratic_cost": 2.0345052083333332e-05, "shuffle": False,
        "drop_staleness": -1}
    fingerprint_differences(saved, mine) -> ["seq_len: 64 -> 128"]

``drop_staleness`` is ``max_staleness`` under ``on_stale="drop"`` (which samples a step plans
depends on it) and -1 otherwise; a state saved before it existed planned with no bound
(:data:`ADDED`).

The field registry is not in it: it changes what is read of a micro batch, not which samples a
micro batch holds. The fingerprint is about configuration; which step file a plan was made from
(its version) is about data and is checked as the step is read
(:mod:`~rollfeed.loaders.step_version`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollfeed.loaders.config import LoaderConfig

PLAN_OPTIONS = ("seq_len", "cp_layout", "pad_to_multiple_of", "overlong", "quadratic_cost")
FINGERPRINT_KEYS = (*PLAN_OPTIONS, "shuffle", "drop_staleness")
# Keys added after states were saved without them, with the value such a state planned under.
ADDED = {"drop_staleness": -1}


def plan_fingerprint(config: LoaderConfig) -> dict[str, Any]:
    """The plan-shaping options of ``config`` as plain values (JSON and DCP safe)."""
    plan, stale = config.plan, config.staleness
    drop = stale.max_staleness if stale is not None and stale.on_stale == "drop" else -1
    options = {name: getattr(plan, name) for name in PLAN_OPTIONS}
    return options | {"shuffle": config.shuffle, "drop_staleness": drop}


def fingerprint_differences(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> list[str]:
    """``"option: saved -> mine"`` for every option that differs, in :data:`FINGERPRINT_KEYS`
    order (empty when the plans agree)."""
    return [f"{k}: {saved[k]!r} -> {mine[k]!r}" for k in FINGERPRINT_KEYS if saved[k] != mine[k]]
