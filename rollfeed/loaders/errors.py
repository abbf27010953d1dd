"""Typed loader errors: :class:`~rollfeed.errors.RollfeedError` subclasses that name the value,
the bound and the fix, and the place (step file and line).
"""

from __future__ import annotations

from rollfeed.errors import RollfeedError


class LoaderError(RollfeedError):
    """Base class: loader input, configuration or saved state is not what the loader needs."""

    PLACE = ("file", "line")


class LoaderConfigError(LoaderError):
    """Bad constructor arguments (sizes, ranks, policies)."""


class StepFileError(LoaderError):
    """A step file holds a line that is not a valid sample record."""


class StepTimeoutError(LoaderError):
    """Stream mode: the next step file did not appear within the wait bound."""


class LoaderStateError(LoaderError):
    """A saved state cannot be loaded here (other version, world shape or seed)."""


class EmptyStepError(LoaderError):
    """A step has no micro batch to train on: its file holds no samples, or all were dropped."""


class PlanMismatchError(LoaderConfigError):
    """The collator's planner config is not the one the sampler planned the micro batch with."""
