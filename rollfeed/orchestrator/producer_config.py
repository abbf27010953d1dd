"""What a :class:`~rollfeed.orchestrator.Producer` is asked to do: group size, prompts per step,
sampling, how far ahead of the trainer, and how it waits; and each turn's seed.

Example::

    ProducerConfig(group_size=4, prompts_per_step=8, sampling={"top_k": 20, "seed": 3})
    turn_seed(3, "p17", 2, 0)  # the seed of prompt p17's sample 2, turn 0: one per rollout
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rollfeed.orchestrator.errors import OrchestratorError


@dataclass(frozen=True, kw_only=True, slots=True)
class ProducerConfig:
    """``group_size`` rollouts per prompt, ``prompts_per_step`` prompts per step, ``sampling``
    (the capture route's sampling settings; a ``seed`` there is the run's: each rollout's turn
    gets its own seed derived from it and from its name), at most ``max_ahead`` steps ahead of
    the trainer, ``steps`` steps (default: as many whole steps as the prompts fill),
    ``concurrency`` requests at once, ``policy`` for rows the trainer cannot replay, the payload
    group of step ``k`` named ``f"{group_prefix}step_{k:06d}"`` (a prefix such as ``"run7/"``
    keeps runs that share a server and a payload root apart),
    ``server_wait_s`` for a server that does not answer, the progress file read every
    ``poll_s``; ``vocab_size`` and ``fsync`` as the step writer takes them (``fsync`` also for
    the cursor)."""

    group_size: int
    prompts_per_step: int
    sampling: Mapping[str, Any] = field(default_factory=dict)
    max_ahead: int = 1
    steps: int | None = None
    concurrency: int = 8
    policy: Literal["error", "repair"] = "repair"
    group_prefix: str = ""
    server_wait_s: float = 600.0
    poll_s: float = 0.1
    vocab_size: int | None = None
    fsync: bool = True

    def __post_init__(self) -> None:
        counts = {"group_size": 1, "prompts_per_step": 1, "max_ahead": 0, "concurrency": 1}
        for name, low in counts.items():
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise OrchestratorError(
                    f"ProducerConfig.{name} must be an int >= {low}, got {value!r}"
                )
        if self.steps is not None and (type(self.steps) is not int or self.steps < 0):
            raise OrchestratorError(
                f"ProducerConfig.steps must be None or an int >= 0, got {self.steps!r}"
            )
        for name in ("server_wait_s", "poll_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise OrchestratorError(f"ProducerConfig.{name} must be finite seconds > 0")


def turn_seed(base: int, prompt: str, sample: int, turn: int) -> int:
    """The seed of one turn: the run's ``base`` and the turn's name, so the rollouts of a group
    differ and a turn sent again is sampled as it was (where the engine is deterministic)."""
    return (base * 1_000_003 + zlib.crc32(f"{prompt}/{sample}/{turn}".encode())) % (1 << 31)
