"""LoaderConfig: what a loader yields, one frozen value; how it runs is ``LoaderOptions``.

The plan (:class:`~rollfeed.collate.PlanConfig`: sequence length, CP layout, padding, overlong
policy, balance cost, field registry) and the run's choices around it: which steps, in which
order, how long to wait for a step file, what a resume under another plan or world shape does,
and how the fields are read. The sampler and the collator take the same value; the rank's place
(:class:`~rollfeed.collate.Topology`, which gives the plan its ``cp_size``) and the payload root
are separate arguments of :func:`~rollfeed.loaders.build_dataloader`. Example::

    LoaderConfig(plan=PlanConfig(seq_len=16_384, cp_layout="zigzag"), shuffle=True, seed=7)
    # under Topology(cp_size=2): the plan is split over 2 cp ranks, pad 4
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from rollfeed.collate import PlanConfig
from rollfeed.loaders.errors import LoaderConfigError
from rollfeed.loaders.staleness import ON_STALE, OnStale, Staleness
from rollfeed.payload import ImageProcessorSpec

Reshard = Literal["error", "restart_step", "next_step"]
RESHARD: tuple[Reshard, ...] = ("error", "restart_step", "next_step")


def _count(value: object, *, low: int) -> bool:
    return type(value) is int and value >= low


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderConfig:
    """What the loader yields; checked on construction (:class:`LoaderConfigError` naming the
    field).

    Args:
        plan: the planner's options; its ``cp_size`` is the topology's (leave it at 1).
        seed: seed of ``shuffle`` (an int >= 0).
        shuffle: present a step's samples to the planner in an order drawn from
            ``(seed, step)`` (the same on every rank); otherwise in dataset order.
        stream: every pass is exactly the next step's file (a step directory only).
        start_step: first step (default: the oldest step file present, 0 for a list).
        on_reshard: what a resume does with a state whose interrupted step this loader would
            plan otherwise (another world shape, other plan options, or other samples: its step
            file rewritten since; see :mod:`rollfeed.loaders.state`): ``"error"`` (default,
            names what differs),
            ``"restart_step"`` (replan it and start it over) or ``"next_step"`` (skip its rest).
        step_timeout_s: how long a pass waits for its step file before ``StepTimeoutError``
            (finite seconds >= 0); the wait logs at INFO as it starts and every 30 s.
        width: static ragged width of the kept-set fields (default: each micro batch's widest
            row).
        whole_fields: read fields over the whole row, not this cp rank's window (models that
            shard inside the forward).
        image_processor: the model's image processor
            (:class:`~rollfeed.payload.ImageProcessorSpec`), for steps whose samples hold
            images: each micro batch's images are read by handle and processed with it where
            the micro batch is made (a DataLoader worker), the images its cp rank encodes
            only (:class:`~rollfeed.collate.MediaBatch`).
        max_staleness: the most versions a token's policy version may lag the trained step
            (an int >= 0; ``None``: no bound); beyond it ``on_stale`` decides
            (:mod:`rollfeed.loaders.staleness`).
        on_stale: ``"drop"`` (a sample whose oldest version lags more is not planned, counted),
            ``"mask"`` (its lagging tokens leave the loss, counted) or ``"error"`` (the default:
            :class:`~rollfeed.loaders.staleness.StaleSampleError` naming step, sample and
            version).
    """

    plan: PlanConfig
    seed: int = 0
    shuffle: bool = False
    stream: bool = False
    start_step: int | None = None
    on_reshard: Reshard = "error"
    step_timeout_s: float = 600.0
    width: int | None = None
    whole_fields: bool = False
    image_processor: ImageProcessorSpec | None = None
    max_staleness: int | None = None
    on_stale: OnStale = "error"

    @property
    def staleness(self) -> Staleness | None:
        """The staleness bound and its policy, or ``None`` without a bound."""
        if self.max_staleness is None:
            return None
        return Staleness(max_staleness=self.max_staleness, on_stale=self.on_stale)

    def __post_init__(self) -> None:
        why = None
        seconds = self.step_timeout_s
        flags = {"shuffle": self.shuffle, "stream": self.stream, "whole_fields": self.whole_fields}
        if not isinstance(self.plan, PlanConfig):
            why = f"plan must be a PlanConfig, got {type(self.plan).__name__}"
        elif not _count(self.seed, low=0):
            why = f"seed must be an int >= 0, got {self.seed!r}"
        elif bad := [k for k, v in flags.items() if not isinstance(v, bool)]:
            why = f"{bad[0]} must be a bool, got {flags[bad[0]]!r}"
        elif self.start_step is not None and not _count(self.start_step, low=0):
            why = f"start_step must be None or an int >= 0, got {self.start_step!r}"
        elif self.on_reshard not in RESHARD:
            why = f"on_reshard must be one of {RESHARD}, got {self.on_reshard!r}"
        elif isinstance(seconds, bool) or not isinstance(seconds, int | float):
            why = f"step_timeout_s must be a number of seconds, got {seconds!r}"
        elif not 0 <= seconds < math.inf:
            why = f"step_timeout_s must be finite seconds >= 0 (600 by default), got {seconds}"
        elif self.max_staleness is not None and not _count(self.max_staleness, low=0):
            why = f"max_staleness must be None or an int >= 0, got {self.max_staleness!r}"
        elif self.on_stale not in ON_STALE:
            why = f"on_stale must be one of {ON_STALE}, got {self.on_stale!r}"
        elif self.width is not None and not _count(self.width, low=1):
            why = f"width must be None or an int >= 1, got {self.width!r}"
        elif self.image_processor is not None and not isinstance(
            self.image_processor, ImageProcessorSpec
        ):
            why = (
                "image_processor must be an ImageProcessorSpec (ImageProcessorSpec.of(processor)"
                f"), got {type(self.image_processor).__name__}"
            )
        if why is not None:
            raise LoaderConfigError(f"LoaderConfig.{why}")
