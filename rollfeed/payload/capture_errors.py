"""Typed errors of the inference-side capture (engine outputs -> payload segments).

Each is a :class:`~rollfeed.payload.PayloadError` (so a ``ValueError``): it names the value, the
bound it broke and the fix; ``pos`` is the completion token index where one applies.
"""

from __future__ import annotations

from rollfeed.payload.errors import PayloadError


class CaptureError(PayloadError):
    """Base class: engine outputs or settings that the capture cannot turn into replayable data."""


class SamplingSettingsError(CaptureError):
    """Sampling settings the trainer cannot replay (no top_k bound, greedy, penalties, biases)."""


class CaptureModeError(CaptureError):
    """The engine's logprobs are not the processed (kept-set normalised) ones the capture needs."""


class SupportMembershipError(CaptureError):
    """The sampled token is not in the kept set recovered for its position."""


class SupportBoundError(CaptureError):
    """All requested logprob entries are finite: the kept set may exceed what was returned."""


class RoutingShapeError(CaptureError):
    """Routed experts whose shape, row count or ids do not match the request."""
