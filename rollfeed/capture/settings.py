"""Sampling settings as asked and as the engine will use them: refuse any the engine would change.

The trainer replays ``softmax(logits / T)`` over the recorded kept set with the temperature the
records carry, so that temperature must be the one the engine sampled with. vLLM changes some
temperatures silently (``vllm/sampling_params.py``, ``SamplingParams.__post_init__``):

- ``0 < T < 0.01`` is raised to ``0.01`` (``_MAX_TEMP``, the *floor*): a request for ``0.005``
  samples at ``0.01``;
- ``T < 1e-5`` (``_SAMPLING_EPS``) is greedy decoding: ``top_k``, ``top_p`` and ``min_p`` are reset
  and there is no distribution to replay.

So a capture refuses, before the engine sees the request, ``T == 0`` (greedy), ``0 < T < floor``
(naming the floor), and a temperature that is not a finite number >= 0; and after vLLM built its
``SamplingParams`` it refuses any asked setting the params hold differently
(:func:`changed_settings`). The floors are vLLM's (:class:`EngineFloors`; its private
``_MAX_TEMP`` and ``_SAMPLING_EPS``), written here rather than read from vLLM's private names; a
vLLM that moved them would still be caught by the after-build comparison, and the tests hold them
to the installed vLLM's behaviour.

Example: ``check_requested({"temperature": 0.005, "top_k": 20})`` raises
``SamplingSettingsError("... temperature=0.005 lies below vLLM's floor 0.01 ...")``;
``{"temperature": 0.01, "top_k": 20}`` passes, and so does ``{"top_k": 20}`` (vLLM's 1.0).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollfeed.capture.errors import SamplingSettingsError

# The sampling settings whose value the kept set depends on: compared as asked and as built.
SAMPLED = ("temperature", "top_k", "top_p", "min_p")


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineFloors:
    """Where vLLM changes a temperature. temperature_floor: ``0 < T <`` it is raised to it.
    greedy_below: ``T <`` it samples greedily. Defaults: vLLM's values (0.32)."""

    temperature_floor: float = 1e-2
    greedy_below: float = 1e-5


def temperature_problem(temperature: Any, floors: EngineFloors) -> str | None:
    """Why the capture refuses ``temperature`` as asked, or None when the engine uses it as is."""
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        return f"temperature={temperature!r}: a temperature is a number"
    if not math.isfinite(temperature) or temperature < 0:
        return f"temperature={temperature!r}: a temperature is a finite number >= 0"
    if temperature == 0:
        return (
            f"temperature={temperature!r}: greedy decoding has no distribution to replay "
            "(vLLM then ignores top_k, top_p and min_p)"
        )
    if temperature < floors.temperature_floor:
        return (
            f"temperature={temperature!r} lies below vLLM's floor {floors.temperature_floor}: "
            f"vLLM would sample at {floors.temperature_floor} while the records said "
            f"{temperature!r}; ask for {floors.temperature_floor} or more"
        )
    return None


def check_requested(sampling: Mapping[str, Any], floors: EngineFloors | None = None) -> None:
    """Refuse (:class:`SamplingSettingsError`) an asked temperature the engine would change.

    ``sampling``: the asked settings (a missing temperature is vLLM's default, 1.0).
    """
    if "temperature" not in sampling:
        return
    problem = temperature_problem(sampling["temperature"], floors or EngineFloors())
    if problem is not None:
        raise SamplingSettingsError("sampling settings refused for capture: " + problem)


def changed_settings(sampling: Mapping[str, Any], params: Any) -> list[str]:
    """The asked settings (of :data:`SAMPLED`) that ``params`` holds differently.

    Example: ``changed_settings({"temperature": 0.005}, SamplingParams(temperature=0.005))`` ->
    ``["temperature=0.005 asked, the engine would use 0.01"]``.
    """
    changed = []
    for name in SAMPLED:
        if name in sampling and sampling[name] is not None:
            used = getattr(params, name, None)
            if used != sampling[name]:
                changed.append(f"{name}={sampling[name]!r} asked, the engine would use {used!r}")
    return changed


def check_unchanged(sampling: Mapping[str, Any], params: Any) -> None:
    """Refuse ``params`` whose sampled settings differ from those asked (see module doc)."""
    changed = changed_settings(sampling, params)
    if changed:
        raise SamplingSettingsError(
            "sampling settings refused for capture: the records would not name what the engine "
            "samples with: " + "; ".join(changed)
        )
