"""Typed errors of the loss objectives: :class:`~rollfeed.errors.RollfeedError` subclasses naming
the input ``tensor`` (``"mask_logprobs"``, ``"kept_logprobs"``, ...) and the row ``pos`` in it.

Example::

    ObjectiveInputError("mask_logprobs row 3 holds 2 values for a kept set of 3 ids",
                        tensor="mask_logprobs", pos=3)
    -> "mask_logprobs row 3 holds 2 values for a kept set of 3 ids [tensor=mask_logprobs, pos=3]"
"""

from __future__ import annotations

from rollfeed.errors import RollfeedError


class ObjectiveError(RollfeedError):
    """Base class: inputs or options a loss objective cannot use exactly."""

    PLACE = ("tensor", "pos")


class ObjectiveInputError(ObjectiveError):
    """Bad shapes, dtypes, alignment or option values given to an objective."""


class ObjectiveCompositionError(ObjectiveError):
    """Options that do not compose as given: score centering with a sequence-level weight or the
    PPO clip needs the token-level weight of its correction named."""
