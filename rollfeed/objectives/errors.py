"""Typed errors of the loss objectives: :class:`~rollfeed.errors.RollfeedError` subclasses naming
the input ``tensor`` (``"mask_logprobs"``, ``"support_logprobs"``, ...) and the row ``pos`` in it.

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
    """Bad shapes, dtypes, alignment, positions or option values given to an objective, or a
    value that cannot be a logprob (NaN, ``+inf``) where one should be."""


class ObjectiveCompositionError(ObjectiveError):
    """Options that do not compose as given: score centering with a sequence-level weight or the
    PPO clip needs the token-level weight of its correction named."""


class ObjectiveMissingInputError(ObjectiveInputError):
    """An objective needs an input it did not get (score centering: a loss token's kept set or
    its mask logprobs); the message names the input and how to write it."""


class NoSamplerLogprobError(ObjectiveInputError):
    """A loss token without the sampler's logprob of its sampled token (``-inf``, or vLLM's JSON
    clamp ``-9999`` and below, at the label's mask slot and in ``inference_logprobs``) under
    ``no_sampler_logprob="error"``."""


class ObjectiveOverflowError(ObjectiveError):
    """A loss token's term or its gradient does not fit the dtype: an unbounded weight (the PPO
    clip of a negative advantage without a cap, ``TruncatedIS(cap=inf)``, ``MaskedIS(high=inf)``)
    at a ratio beyond its range, or a trainer logprob of ``-inf`` under a weight that keeps it."""
